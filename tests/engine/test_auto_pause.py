"""A step that pauses itself when its receiver keeps failing (issue 37, ``pause_after``): after the
policy's count of failures of one kind across the workflow's runs, the step is paused for the
whole workflow — no run spends its retry budget into review — one alert is raised (not one per
run) and resolved when a supervisor releases the pause; then every run completes, one entry each."""

from __future__ import annotations

from datetime import timedelta

import pytest

from recovery import why
from recovery.engine.transitions import AUTO_PAUSED, workflow_unpause
from recovery.models import Alert, AlertState, AuditEvent, RunState, WorkflowPause, WorkflowRun
from recovery.observability import alerts
from recovery.workflow import PauseAfter
from tests.support import receivers, workflows
from tests.support.engine import assert_invariants, drive, person

pytestmark = pytest.mark.django_db

POLICY = PauseAfter(failures=3, within=timedelta(minutes=2))  # below FAST's 4 attempts a step


def started(order_id: str) -> WorkflowRun:
    from recovery.engine.transitions import run_start

    return run_start(workflow="test_orders", data={"tenant": "t", "order_id": order_id})[0]


@pytest.fixture
def policy(monkeypatch):
    monkeypatch.setattr(workflows.orders, "pause_after", POLICY)
    monkeypatch.setattr(alerts.settings, "RECOVERY_ALERT_WEBHOOK_URL", "")
    monkeypatch.setattr(alerts.settings, "RECOVERY_ALERT_EMAILS", [])


def test_a_ledger_that_keeps_failing_pauses_its_step_once_with_one_alert_and_no_run_in_review(clock, policy):
    receivers.arm("ledger", "unavailable", times=100)
    runs = [drive(started(f"a-{i}"), clock) for i in range(5)]
    assert [r.state for r in runs] == [RunState.PAUSED] * 5
    assert not WorkflowRun.objects.filter(state=RunState.NEEDS_REVIEW).exists()
    pause = WorkflowPause.objects.get()
    assert (pause.workflow_name, pause.step_name, pause.paused_by, pause.automatic) == (
        "test_orders",
        "post_entry",
        "auto-pause",
        True,
    )
    assert pause.reason.startswith("3 attempts of post_entry failed (transient) within 0:02:00: the receiver keeps")
    assert pause.trigger_run_id == runs[0].pk
    # The first run's three failures tripped it; the others stopped before their first attempt.
    failed = AuditEvent.objects.filter(action="step_fail", step_name="post_entry")
    assert failed.count() == 3 and set(failed.values_list("run", flat=True)) == {runs[0].pk}
    assert receivers.counts()["ledger"] == 0
    said = why.why_not_moving(runs[4], list(runs[4].steps.all()), now=clock.now())
    assert said.startswith("paused by auto-pause at ") and "step post_entry of test_orders paused: 3 attempts" in said

    assert alerts.sweep(clock.now())["raised"] == 1
    assert alerts.sweep(clock.now())["raised"] == 0  # one alert, whatever the runs it holds
    alert = Alert.objects.get()
    assert (alert.cause, alert.run_id, alert.workflow_pause_id, alert.state) == (
        AUTO_PAUSED,
        runs[0].pk,
        pause.pk,
        AlertState.FIRING,
    )
    assert alert.why.startswith("step post_entry of test_orders paused by itself: 3 attempts of post_entry failed")
    clock.advance(3600)  # its run moves on (or not): the alert stays until the pause is released
    assert alerts.sweep(clock.now())["resolved"] == 0

    receivers.clear()  # the ledger is back
    released = workflow_unpause(
        workflow="test_orders", step_name="post_entry", actor=person("sam"), reason="ledger back"
    )
    assert sorted(released["released"]) == sorted(r.workflow_id for r in runs)
    assert alerts.sweep(clock.now())["resolved"] == 1
    alert.refresh_from_db()
    assert alert.state == AlertState.RESOLVED
    assert [drive(r, clock).state for r in runs] == [RunState.COMPLETED] * 5
    assert receivers.counts() == {"task": 5, "message": 5, "ledger": 5, "model_call": 5}
    assert_invariants()


def test_failures_of_another_kind_or_older_than_the_window_do_not_pause(clock, policy, monkeypatch):
    receivers.arm("ledger", "unavailable", times=2)
    run = drive(started("b-1"), clock)  # two transient failures, then it succeeds
    assert run.state == RunState.COMPLETED
    clock.advance(3 * 60)  # the window has passed
    receivers.arm("ledger", "unavailable", times=2)
    assert drive(started("b-2"), clock).state == RunState.COMPLETED  # 2 in the window, not 3
    receivers.arm("ledger", "rate_limit", times=1)
    assert drive(started("b-3"), clock).state == RunState.COMPLETED  # another kind
    assert not WorkflowPause.objects.exists()


def test_no_policy_no_pause_the_runs_spend_their_budget_into_review(clock):
    receivers.arm("ledger", "unavailable", times=100)
    run = drive(started("c-1"), clock)
    assert run.state == RunState.NEEDS_REVIEW and not WorkflowPause.objects.exists()


def test_a_policy_is_checked_when_it_is_declared():
    with pytest.raises(ValueError, match="pause_after: failures is at least 1"):
        PauseAfter(failures=0, within=timedelta(minutes=2))
    with pytest.raises(ValueError, match="pause_after: failures is at least 1"):
        PauseAfter(failures=3, within=timedelta(0))


def test_the_alert_of_a_paused_step_points_to_the_incident_not_to_one_run(clock, policy):
    from recovery.engine.transitions import alert_raise_paused

    receivers.arm("ledger", "unavailable", times=100)
    drive(started("d-1"), clock)
    alert = alert_raise_paused(pause_pk=WorkflowPause.objects.get().pk, channels=["webhook"], now=clock.now())
    assert alert_raise_paused(pause_pk=alert.workflow_pause_id, channels=["webhook"], now=clock.now()) is None
    data = alerts.payload(alert.deliveries.get())
    assert data["cause"] == AUTO_PAUSED and data["cause_label"] == "Step paused by itself"
    assert data["paused"] == "step post_entry of test_orders" and data["url"].endswith("/dashboard#workflow-pauses")
    raised = AuditEvent.objects.get(action="alert_raised")
    assert raised.run_id == alert.run_id and raised.reason.startswith("step post_entry of test_orders paused by itself")


def test_metrics_say_how_long_each_pause_has_held(clock, policy):
    from recovery.engine.transitions import workflow_pause
    from recovery.observability.exposition import DatabaseGauges

    receivers.arm("ledger", "unavailable", times=100)
    drive(started("e-1"), clock)  # the ledger step pauses itself
    workflow_pause(workflow="test_orders", step_name="notify", actor=person("sam"), reason="chat outage")
    clock.advance(90)
    family = next(f for f in DatabaseGauges().collect() if f.name == "recovery_paused_since_seconds")
    held = {(s.labels["step"], s.labels["by"]): s.value for s in family.samples}
    auto = WorkflowPause.objects.get(automatic=True)
    since = (clock.now() - auto.paused_at).total_seconds()
    assert since >= 90 and held == {("notify", "supervisor"): 90.0, ("post_entry", "automatic"): since}


def test_executors_lost_mid_call_are_not_failures_of_the_receiver(clock, policy, monkeypatch):
    """A deploy or a crash that kills workers in the middle of ledger calls leaves those calls'
    outcomes unknown (each takeover records ``step_unknown``): that says nothing about the
    ledger, and must not add up with its real failures to pause the step for every run. (The CI
    soak's SIGKILLed workers paused post_ledger_entry this way: four executors lost plus one
    answer that never came made five.)"""
    from recovery.engine import failpoints
    from tests.support.engine import doomed_worker

    def killed(name, at):
        if (name, at) == ("post_entry", "after_call"):
            raise failpoints.FailpointRaised("killed at post_entry:after_call")

    runs = []
    for i in range(POLICY.failures):
        run = started(f"k-{i}")
        monkeypatch.setattr(failpoints, "hit", killed)
        doomed_worker(run, clock)  # the ledger committed; the worker died before recording it
        monkeypatch.setattr(failpoints, "hit", lambda name, at: None)
        runs.append(drive(run, clock))  # taken over: unknown, found by look-up, completed
    lost = AuditEvent.objects.filter(action="step_unknown", step_name="post_entry")
    assert lost.count() == POLICY.failures
    assert [r.state for r in runs] == [RunState.COMPLETED] * POLICY.failures

    receivers.arm("ledger", "commit_then_drop", times=1)  # the receiver's own: an answer lost
    runs.append(drive(started("k-last"), clock))
    assert lost.count() == POLICY.failures + 1
    assert not WorkflowPause.objects.exists()
    assert [r.state for r in runs] == [RunState.COMPLETED] * (POLICY.failures + 1)
    assert receivers.counts()["ledger"] == POLICY.failures + 1  # one entry per run

    # Failures the receiver answered still count, the lost executors' aside: two more answers
    # lost make three of the ledger's own, and the step pauses.
    receivers.arm("ledger", "commit_then_drop", times=2)
    drive(started("k-more-1"), clock)
    drive(started("k-more-2"), clock)
    pause = WorkflowPause.objects.get()
    assert pause.reason.startswith("3 attempts of post_entry failed (unknown_outcome) within 0:02:00")
