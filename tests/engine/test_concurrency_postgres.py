"""Concurrency on PostgreSQL: unique constraints and leases, not pre-checks, decide.

On SQLite these skip: it serialises writers, so it cannot show a race.
"""

import threading
from collections import Counter

import pytest
from django.db import connections

from recovery.engine.audit import chain as audit_chain
from recovery.engine.executor import advance
from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, StepExecution, WorkflowRun
from tests.support import receivers

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

EVENT = {"tenant": "t42", "order_id": "inv-1847", "text": "office chairs 120"}


def in_threads(n: int, fn) -> list:
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list = []

    def worker(i: int) -> None:
        try:
            barrier.wait()
            results[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def assert_chains_intact() -> None:
    """Every run's audit events form one unbroken hash chain: no two writers of a run's
    events ever read the same previous event (each holds the run's lock)."""
    result = audit_chain.verify(audit_chain.stored_chains())
    assert result.first is None, str(result.first)
    assert result.events == AuditEvent.objects.count() and result.runs == WorkflowRun.objects.count()


def test_fifty_concurrent_starts_of_one_event_make_one_run(postgres_only):
    results = in_threads(50, lambda i: run_start(workflow="test_orders", data=dict(EVENT)))
    assert WorkflowRun.objects.count() == 1
    assert len({run.pk for run, _ in results}) == 1
    assert Counter(created for _, created in results) == Counter({True: 1, False: 49})
    assert StepExecution.objects.count() == 5
    assert AuditEvent.objects.filter(action="start").count() == 1


def test_the_same_queue_event_delivered_concurrently_makes_one_copy_of_each_effect(postgres_only, monkeypatch):
    """failure test 8: twenty consumers get the same event at once; each starts and advances."""
    monkeypatch.setenv("RECOVERY_FAILPOINTS", "*:before_call=sleep(20)")

    def consume(i):
        run, _ = run_start(workflow="test_orders", data=dict(EVENT))
        for _ in range(5):
            advance(run.pk, owner=f"consumer-{i}")
        return run.pk

    pks = in_threads(20, consume)
    assert len(set(pks)) == 1
    run = WorkflowRun.objects.get()
    assert run.state == "completed"
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
    assert all(s.attempts == 1 for s in run.steps.all())
    assert_chains_intact()


def test_two_executors_racing_for_one_run_never_both_perform_a_step(postgres_only, monkeypatch):
    monkeypatch.setenv("RECOVERY_FAILPOINTS", "*:before_call=sleep(50)")
    runs = [run_start(workflow="test_orders", data={**EVENT, "order_id": f"race-{i}"})[0] for i in range(5)]

    def executor(i):
        claimed = 0
        for _ in range(10):
            for run in runs:
                claimed += advance(run.pk, owner=f"executor-{i}") is not None
        return claimed

    in_threads(2, executor)
    assert set(WorkflowRun.objects.values_list("state", flat=True)) == {"completed"}
    assert receivers.counts() == {"task": 5, "message": 5, "ledger": 5, "model_call": 5}
    assert set(StepExecution.objects.values_list("attempts", flat=True)) == {1}
    # each step began exactly once, whichever executor held the run at the time
    assert AuditEvent.objects.filter(action="step_begin").count() == 25
    assert_chains_intact()


def test_executors_side_by_side_take_different_runs_and_perform_each_step_once(postgres_only, monkeypatch):
    """The embedded executor's loop (run_due: claim the oldest due run, SKIP LOCKED) in four
    threads over twenty runs: every run completed, every step performed once, and no run
    claimed twice (a claim another executor already made is skipped, not retried)."""
    from recovery.engine.loop import run_due

    monkeypatch.setenv("RECOVERY_FAILPOINTS", "*:before_call=sleep(5)")
    for i in range(20):
        run_start(workflow="test_orders", data={**EVENT, "order_id": f"side-{i}"})

    advanced = in_threads(4, lambda i: run_due(owner=f"executor-{i}"))

    assert sum(advanced) == 20
    assert set(WorkflowRun.objects.values_list("state", flat=True)) == {"completed"}
    assert receivers.counts() == {"task": 20, "message": 20, "ledger": 20, "model_call": 20}
    assert set(StepExecution.objects.values_list("attempts", flat=True)) == {1}
    assert AuditEvent.objects.filter(action="claim").count() == 20
    assert AuditEvent.objects.filter(action="step_begin").count() == 100
    assert_chains_intact()
