"""Runs stuck for each cause the console recommends an action for (recovery.actions.RECOMMENDED),
built by driving test_orders / test_policy through the counting receivers."""

import json

from recovery.engine.transitions import perform, run_start
from recovery.models import RunState, WorkflowRun
from tests.support import receivers, workflows
from tests.support.engine import drive, person


def start(clock, order_id: str, workflow: str = "test_orders"):
    return drive(run_start(workflow=workflow, data={"tenant": "t", "order_id": order_id})[0], clock)


def unknown(clock, monkeypatch, order_id: str = "unknown"):
    """notify's outcome unknown and its look-up down: needs review."""
    receivers.arm("message", "commit_then_drop")
    monkeypatch.setattr(workflows.notify, "lookup_fn", lambda ctx: (_ for _ in ()).throw(RuntimeError("down")))
    return start(clock, order_id)


def exhausted(clock, order_id: str = "exhausted"):
    """post_entry failed on every attempt (the ledger unavailable): needs review."""
    receivers.arm("ledger", "unavailable", times=10)
    return start(clock, order_id)


def policy_refused(clock, order_id: str = "refused"):
    """The model proposed an approver the policy refuses: nothing written, needs review."""
    receivers.MODEL_SCRIPT.append(json.dumps({"category": "office", "amount": 120, "approver": "mallory"}))
    return start(clock, order_id, "test_policy")


def failed_with_effects(clock, order_id: str = "failed"):
    """Failed at post_entry after create_task and notify made their effects (set as a permanent
    failure would leave it: the receivers here only fail post_entry transiently)."""
    run = exhausted(clock, order_id)
    WorkflowRun.objects.filter(pk=run.pk).update(state=RunState.FAILED, effects_stand=True)
    run.refresh_from_db()
    return run


def compensation_failed(clock, order_id: str = "comp-failed"):
    """A failed run whose compensation of notify (the first undone) failed for good."""
    run = failed_with_effects(clock, order_id)
    receivers.arm("correction", "forbidden")
    perform("compensate", workflow_id=run.workflow_id, actor=person("stuck-builder", "supervisor"), reason="undo it")
    return drive(run, clock)
