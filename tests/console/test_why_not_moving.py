""" "Why is this run not moving?" (issue 16, items 2, 3 and 12): one sentence from the run's
state, the same on the runs list, the run page and ``show_run``; and "stuck" means a person
must act or something is wrong — a failed run whose effects stand, an approval waiting, an
unknown outcome nobody is about to look up — not "the engine is waiting as planned"."""

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.conf import settings
from django.core.management import call_command
from django.urls import reverse

from recovery.console.selectors import RunFilters
from recovery.engine.executor import advance
from recovery.engine.transitions import approval_request, run_start
from recovery.models import RunState, WorkflowRun
from tests.support import receivers, workflows
from tests.support.console import login
from tests.support.engine import crash_at, drive, person

pytestmark = pytest.mark.django_db(transaction=True)


def start(order_id: str, workflow: str = "test_orders") -> WorkflowRun:
    return run_start(workflow=workflow, data={"tenant": "t", "order_id": order_id})[0]


@pytest.fixture
def said(db):
    """The sentence as the runs list and the run page give it (show_run, text and JSON, must
    say what the page says)."""
    client = login("viewer")

    def say(run: WorkflowRun) -> tuple[str, str]:
        listed = client.get(reverse("console:runs"), {"q": run.workflow_id}).context["runs"][0].why
        page = client.get(reverse("console:run", args=[run.workflow_id])).context["why"]
        out = StringIO()
        call_command("show_run", run.workflow_id, stdout=out)
        text = next(line for line in out.getvalue().splitlines() if line.startswith("  why: "))
        out = StringIO()
        call_command("show_run", run.workflow_id, "--json", stdout=out)
        assert json.loads(out.getvalue())["why"] == page == text.removeprefix("  why: ")
        return listed, page

    return say


def test_a_run_waiting_to_retry_says_which_step_when_and_which_attempt(said, clock):
    receivers.arm("task", "rate_limit")
    run = start("retry")
    advance(run.pk)
    run.refresh_from_db()
    listed, page = said(run)
    at = f"{run.next_wake_at:%H:%M:%S} UTC"  # every time with its zone
    assert page == f"retrying create_task at {at} (attempt 2 of 4; rate_limited: task: 429 too many requests)"
    assert listed == page


def test_a_held_run_names_its_executor_and_a_lost_lease_says_so(said, clock, monkeypatch):
    run = start("held")
    crash_at(monkeypatch, "create_task:after_call", lambda: advance(run.pk, owner="w2@host"))
    run.refresh_from_db()
    until = f"{run.lease_expires_at:%H:%M:%S} UTC"
    assert said(run)[1] == f"held by executor w2@host until {until} (lease), running create_task"
    clock.advance(settings.RECOVERY_LEASE_SECONDS + 1)
    assert said(run)[1] == (
        f"the lease of w2@host expired at {until}: waiting for another executor to take the run over"
    )
    assert run in RunFilters(stuck="lease_expired").newest(clock.now(), limit=5)


def test_review_failure_and_compensation_each_say_what_a_person_must_do(said, clock, monkeypatch):
    receivers.arm("message", "commit_then_drop")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(workflows.notify, "lookup_fn", lambda ctx: (_ for _ in ()).throw(RuntimeError("down")))
        unknown = drive(start("unknown"), clock)
    assert said(unknown)[1] == (
        "outcome of notify unknown: an operator must reconcile it (look it up by key, or settle it with "
        "evidence the receiver confirms)"
    )
    with pytest.MonkeyPatch.context() as patch:  # a step whose evidence cannot be checked says so
        patch.setattr(workflows.notify, "lookup_ref_fn", None)
        assert said(unknown)[1] == (
            "outcome of notify unknown: an operator must reconcile it (look it up by key; evidence cannot be "
            "recorded for it, as its receiver cannot be asked by id and it declares no result schema)"
        )

    receivers.arm("task", "forbidden")
    early = drive(start("early"), clock)
    assert said(early)[1] == "failed at create_task (task: 403 forbidden); nothing was written elsewhere"

    receivers.arm("ledger", "forbidden")
    late = drive(start("late"), clock)
    assert said(late)[1] == (
        "failed at post_entry (ledger: 403 forbidden); effects made by create_task, notify stand: "
        "compensate them, or terminate to keep them"
    )

    receivers.MODEL_SCRIPT.append(json.dumps({"category": "office", "amount": 120, "approver": "mallory"}))
    refused = drive(start("refused", "test_policy"), clock)
    assert said(refused)[1] == (
        "paused: policy refused create_task (approver_policy: mallory may not approve 120); "
        "change the decision, or a supervisor accepts the proposal"
    )


def test_stuck_means_a_person_must_act(said, clock):
    receivers.arm("task", "forbidden")
    early = drive(start("early"), clock)  # failed, nothing written: finished, not stuck
    receivers.arm("ledger", "forbidden")
    late = drive(start("late"), clock)  # failed with a task and a message standing
    receivers.arm("task", "rate_limit")
    waiting = start("waiting")  # waiting for its retry as planned: not stuck
    advance(waiting.pk)
    stuck = set(RunFilters(stuck="any").newest(clock.now(), limit=50))
    assert late in stuck and early not in stuck and waiting not in stuck
    assert list(RunFilters(stuck="failed_with_effects").newest(clock.now(), limit=5)) == [late]


def test_a_run_waiting_for_a_second_supervisor_says_who_asked_and_is_stuck(said, clock):
    receivers.arm("task", "forbidden")
    run = drive(start("4eyes", "test_guarded"), clock)
    approval_request(workflow_id=run.workflow_id, action="terminate", actor=person("olga"), reason="duplicate")
    listed, page = said(run)
    assert page == listed == "waiting for a supervisor to approve terminate (requested by olga)"
    assert list(RunFilters(stuck="approval").newest(clock.now(), limit=5)) == [run]


def test_an_unknown_outcome_being_looked_up_again_is_not_stuck_until_then(said, clock, monkeypatch):
    """A look-up missed while the request may still commit: the engine looks again at the window's
    end (waiting, with a time); only a review makes it a person's business."""
    receivers.arm("message", "commit_then_drop")
    monkeypatch.setattr(workflows.notify, "lookup_fn", lambda ctx: None)  # finds nothing yet
    run = start("settling")
    for _ in range(4):
        advance(run.pk)
        run.refresh_from_db()
        if run.state == RunState.WAITING:
            break
    assert run.state == RunState.WAITING
    assert said(run)[1] == f"outcome of notify unknown: looking it up again at {run.next_wake_at:%H:%M:%S} UTC"
    assert run not in RunFilters(stuck="unknown").newest(clock.now(), limit=5)


def test_a_run_reserved_for_a_script_says_for_whom_and_until_when(said, clock):
    until = clock.now() + timedelta(minutes=15)
    run = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "seeded"}, reserve=("seed-demo", until))[0]
    listed, page = said(run)
    assert page == listed == f"reserved for seed-demo until {until:%H:%M:%S} UTC: other executors leave it alone"
    clock.advance(15 * 60)
    assert said(run)[1] == "due now: waiting for an executor to claim it"
