"""The engine's counters count what was committed, exactly: each equals the number of audit
events of its kind, and a transition that rolled back, or whose fenced write matched nothing,
counts nothing."""

from __future__ import annotations

from collections import Counter

import pytest
from django.conf import settings
from django.db import transaction
from prometheus_client import REGISTRY

from recovery.engine import metrics
from recovery.engine.executor import advance
from recovery.engine.transitions import perform, run_claim, run_start, step_begin, step_fail
from recovery.errors import LeaseLost, TransientError
from recovery.models import AuditEvent, RunState
from tests.support import receivers
from tests.support.engine import crash_at, drive, person
from tests.support.workflows import orders

pytestmark = pytest.mark.django_db(transaction=True)

COUNTERS = (
    "recovery_step_attempts_total",
    "recovery_unknown_outcomes_total",
    "recovery_reconciles_total",
    "recovery_lease_takeovers_total",
    "recovery_policy_refusals_total",
    "recovery_operator_actions_total",
    "recovery_step_schedule_to_start_seconds_count",
    "recovery_step_duration_seconds_count",
)


def samples() -> Counter:
    """Every counted sample of this process, by (name, labels)."""
    found: Counter = Counter()
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name in COUNTERS:
                found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def delta(before: Counter) -> dict:
    after = samples()
    return {key: after[key] - before[key] for key in after if after[key] != before[key]}


def key(name: str, **labels: str) -> tuple:
    return (name, tuple(sorted(labels.items())))


def audit_count(run, action: str, step: str | None = None) -> int:
    events = AuditEvent.objects.filter(run=run, action=action)
    return (events.filter(step_name=step) if step else events).count()


def test_a_run_with_a_retry_an_unknown_outcome_and_a_takeover_counts_each_exactly(clock, monkeypatch):
    before = samples()
    receivers.arm("task", "fail_before_commit")  # create_task fails once (transient) and is retried
    receivers.arm("message", "commit_then_drop")  # notify's answer is lost: unknown, then found by look-up
    run, _ = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "metrics"})
    advance(run.pk)  # read, decide, create_task fails: the run waits for its retry
    run.refresh_from_db()
    clock.set(run.next_wake_at)
    # post_entry's executor dies before its call: the next one takes the run over.
    crash_at(monkeypatch, "post_entry:before_call", lambda: advance(run.pk))
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}

    wf = "test_orders"
    attempts = "recovery_step_attempts_total"
    expected = {
        key(attempts, workflow=wf, step="read", outcome="succeeded", error_kind=""): 1,
        key(attempts, workflow=wf, step="decide", outcome="succeeded", error_kind=""): 1,
        key(attempts, workflow=wf, step="create_task", outcome="failed", error_kind="transient"): 1,
        key(attempts, workflow=wf, step="create_task", outcome="succeeded", error_kind=""): 1,
        key(attempts, workflow=wf, step="notify", outcome="unknown", error_kind="unknown_outcome"): 1,
        key(attempts, workflow=wf, step="post_entry", outcome="unknown", error_kind="unknown_outcome"): 1,
        key(attempts, workflow=wf, step="post_entry", outcome="succeeded", error_kind=""): 1,
        key("recovery_unknown_outcomes_total", workflow=wf, step="notify"): 1,
        key("recovery_unknown_outcomes_total", workflow=wf, step="post_entry"): 1,
        key("recovery_reconciles_total", workflow=wf, step="notify", result="happened"): 1,
        # post_entry's look-up finds nothing while its request could still commit, then proves absence.
        key("recovery_reconciles_total", workflow=wf, step="post_entry", result="wait"): 1,
        key("recovery_reconciles_total", workflow=wf, step="post_entry", result="absent"): 1,
        key("recovery_lease_takeovers_total", workflow=wf): 1,
    }
    found = delta(before)
    assert {k: v for k, v in found.items() if not k[0].startswith("recovery_step_")} | {
        k: v for k, v in found.items() if k[0] == attempts
    } == expected

    # Each counter is its audit events, counted: the same facts the run page shows.
    assert sum(v for k, v in found.items() if k[0] == attempts) == sum(
        audit_count(run, a) for a in ("step_succeed", "step_fail", "step_unknown")
    )
    assert found[key("recovery_lease_takeovers_total", workflow=wf)] == audit_count(run, "lease_takeover")
    claims = audit_count(run, "claim") + audit_count(run, "lease_takeover")
    assert found[key("recovery_step_schedule_to_start_seconds_count", workflow=wf)] == claims
    # Every call the executor made was timed: create_task twice, the rest once (post_entry's
    # first executor died before calling).
    durations = {dict(k[1])["step"]: v for k, v in found.items() if k[0] == "recovery_step_duration_seconds_count"}
    assert durations == {"read": 1, "decide": 1, "create_task": 2, "notify": 1, "post_entry": 1}


def test_the_takeover_waited_for_the_lease_to_expire(clock, monkeypatch):
    """schedule-to-start of a takeover counts from the expired lease's end, not from the start."""
    run, _ = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "late-claim"})
    crash_at(monkeypatch, "create_task:before_call", lambda: advance(run.pk))
    clock.advance(settings.RECOVERY_LEASE_SECONDS + 40)
    name = "recovery_step_schedule_to_start_seconds"
    before_sum = REGISTRY.get_sample_value(f"{name}_sum", {"workflow": "test_orders"})
    advance(run.pk)
    waited = REGISTRY.get_sample_value(f"{name}_sum", {"workflow": "test_orders"}) - before_sum
    # A difference of two float sums: the process's earlier samples can leave 39.99999999999999.
    assert 40 <= round(waited, 6) < 40 + settings.RECOVERY_LEASE_SECONDS


def test_a_transition_that_did_not_commit_counts_nothing(clock):
    run, _ = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "rolled-back"})
    stale = run_claim(run_pk=run.pk, owner="first")
    clock.advance(settings.RECOVERY_LEASE_SECONDS + 1)
    lease = run_claim(run_pk=run.pk, owner="second")  # takes the run over: one takeover, counted
    spec = orders.get_step("read")
    before = samples()

    with pytest.raises(LeaseLost):  # the first executor's fenced write matches nothing
        step_fail(lease=stale, step_name="read", error=TransientError("503"), spec=spec)
    with pytest.raises(RuntimeError), transaction.atomic():  # written, then rolled back
        step_begin(lease=lease, step_name="read", intent={}, request_hash="h")
        step_fail(lease=lease, step_name="read", error=TransientError("503"), spec=spec)
        raise RuntimeError("the transaction around it failed")

    assert delta(before) == {}
    assert audit_count(run, "step_fail") == 0


def test_operator_actions_are_counted_by_action_and_role(clock):
    receivers.arm("ledger", "unavailable", times=10)  # post_entry runs out of retries: needs review
    run = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "op"})[0], clock)
    assert run.state == RunState.NEEDS_REVIEW
    before = samples()
    receivers.clear()
    perform("retry", workflow_id=run.workflow_id, step_name="post_entry", actor=person("olga", "operator"), reason="up")
    assert delta(before) == {key("recovery_operator_actions_total", action="retry", role="operator"): 1}


def test_nothing_is_recorded_when_metrics_are_off(clock, settings):
    settings.RECOVERY_METRICS = False
    before = samples()
    drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "off"})[0], clock)
    assert delta(before) == {}


def test_no_label_is_a_workflow_id_a_key_or_a_user():
    """Bounded cardinality: the label names of every engine metric."""
    labels = {
        family: tuple(family._labelnames)
        for family in (
            metrics.STEP_ATTEMPTS,
            metrics.STEP_DURATION,
            metrics.SCHEDULE_TO_START,
            metrics.UNKNOWN_OUTCOMES,
            metrics.RECONCILES,
            metrics.LEASE_TAKEOVERS,
            metrics.POLICY_REFUSALS,
            metrics.OPERATOR_ACTIONS,
        )
    }
    allowed = {"workflow", "step", "outcome", "error_kind", "result", "rule", "action", "role"}
    assert set().union(*labels.values()) <= allowed
