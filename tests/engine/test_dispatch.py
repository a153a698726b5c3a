"""The sweeper under a backlog (celery mode): a run or outbox message that already has a task
on the broker is not queued again by every sweep, only once that task is old enough to be
presumed lost; a claim consumes the task, so the next due time is queued exactly once.

The broker is replaced by a list of what would have been sent: what is under test is the
bookkeeping that decides whether to send, not Celery (tests/slow/test_celery_runtime.py and
the soak run the real broker)."""

import pytest

from recovery import tasks
from recovery.engine.executor import advance
from recovery.engine.transitions import run_start
from recovery.models import RunState, WorkflowRun
from tests.support import receivers
from tests.support.engine import drive

pytestmark = pytest.mark.django_db

REDISPATCH = 60


@pytest.fixture
def sent(settings, monkeypatch, django_capture_on_commit_callbacks):
    settings.RECOVERY_EXECUTOR = "celery"
    settings.RECOVERY_REDISPATCH_SECONDS = REDISPATCH
    queued: list[tuple[str, int]] = []
    monkeypatch.setattr(tasks.advance_run, "delay", lambda pk: queued.append(("advance_run", pk)))
    monkeypatch.setattr(tasks.publish_outbox, "delay", lambda pk: queued.append(("publish_outbox", pk)))
    return queued


def start(order_id: str, capture) -> WorkflowRun:
    with capture(execute=True):
        return run_start(workflow="test_orders", data={"tenant": "t", "order_id": order_id})[0]


def sweep(capture) -> int:
    with capture(execute=True):
        return tasks.sweep()


def test_a_run_queued_on_start_is_queued_again_only_once_its_task_is_presumed_lost(
    sent, clock, django_capture_on_commit_callbacks
):
    capture = django_capture_on_commit_callbacks
    run = start("1", capture)
    assert sent == [("advance_run", run.pk)]  # on commit

    for _ in range(5):  # sweeps every few seconds while the task waits behind a backlog
        clock.advance(5)
        assert sweep(capture) == 0
    assert sent == [("advance_run", run.pk)]

    clock.advance(REDISPATCH - 25 + 1)  # no worker took it for longer than the redispatch time
    assert sweep(capture) == 1
    assert sweep(capture) == 0
    assert sent == [("advance_run", run.pk)] * 2


def test_a_run_never_queued_is_queued_by_the_next_sweep_and_not_by_the_one_after(
    sent, clock, django_capture_on_commit_callbacks, settings
):
    capture = django_capture_on_commit_callbacks
    settings.RECOVERY_EXECUTOR = "embedded"  # started by a process that queued nothing
    runs = [start(str(i), capture) for i in range(3)]
    settings.RECOVERY_EXECUTOR = "celery"
    assert sent == []

    assert sweep(capture) == 3
    assert sweep(capture) == 0
    assert sorted(sent) == [("advance_run", r.pk) for r in runs]


def test_a_claim_consumes_the_queued_task_so_the_retry_time_is_queued_exactly_once(
    sent, clock, django_capture_on_commit_callbacks
):
    capture = django_capture_on_commit_callbacks
    run = start("1", capture)
    receivers.arm("task", "unavailable")
    assert advance(run.pk) == RunState.WAITING  # the queued task ran: a retry is due in ~1 s
    run.refresh_from_db()
    assert run.dispatched_at is None

    assert sweep(capture) == 0  # not due yet
    clock.advance(5)
    assert sweep(capture) == 1
    clock.advance(5)
    assert sweep(capture) == 0  # still queued: a backlog is not multiplied
    assert sent == [("advance_run", run.pk)] * 2

    assert drive(run, clock).state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
    clock.advance(REDISPATCH * 2)
    assert sweep(capture) == 0  # finished runs are never queued
