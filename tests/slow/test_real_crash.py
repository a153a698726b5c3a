"""A real crash: a worker process is SIGKILLed at a failpoint; a second process resumes.

failure tests 1 and 2 with real processes: the receiver's commit survives in its own
transaction, the dead worker's step is found `running` past its lease, treated as unknown,
reconciled, and exactly one remote object exists.

No assertion races the wall clock: the dead worker's lease is long (conftest.LEASE), and the
processes that come after it run on an engine clock pinned to instants read from the run's own
row — one second before its ``lease_expires_at`` (nobody may take it), one second after (the
takeover).
"""

import json
import signal
from datetime import timedelta

import pytest

from recovery.engine.transitions import claimable
from recovery.models import RunState, StepState, WorkflowRun
from tests.slow.conftest import LEASE, MARGIN, manage
from tests.support import receivers

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

KIND = {"create_task": "task", "notify": "message", "post_entry": "ledger"}


def lease_of(run: WorkflowRun) -> tuple:
    run.refresh_from_db()
    return run.state, run.lease_owner, run.lease_generation, run.lease_expires_at, run.revision, run.updated_at


def claimable_at(run: WorkflowRun, at) -> bool:
    return WorkflowRun.objects.filter(claimable(at), pk=run.pk).exists()


@pytest.mark.parametrize(
    "step,point",
    [
        ("create_task", "after_call"),  # receiver honours keys: resend the same key
        ("notify", "after_call"),  # receiver does not: look up by client reference
        ("post_entry", "after_call"),  # unique reference: look up
        ("create_task", "before_call"),  # crash before the request: performed exactly once
    ],
)
def test_worker_killed_at_a_failpoint_is_resumed_by_another_process_with_one_object(step, point):
    event = {"tenant": "t42", "order_id": f"crash-{step}-{point}", "text": "office chairs 120"}
    started = manage("start_workflow", "test_orders", "--input", json.dumps(event))
    assert started.returncode == 0, started.stderr
    wid = started.stdout.strip()

    crashed = manage("run_executor", "--until-idle", RECOVERY_FAILPOINTS=f"{step}:{point}=crash")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    run = WorkflowRun.objects.get(workflow_id=wid)
    assert run.state == RunState.RUNNING
    assert run.steps.get(step_name=step).state == StepState.RUNNING
    expected_after_crash = 1 if point == "after_call" else 0
    kind = KIND[step]
    assert receivers.counts()[kind] == expected_after_crash

    # The dead worker still holds the run: its own lease, renewed at its last checkpoint for
    # LEASE seconds. Claimable once that has passed, not a moment before (times from the row).
    assert run.lease_owner == crashed.owner
    assert run.lease_expires_at == run.updated_at + timedelta(seconds=LEASE)
    expires, dead_generation = run.lease_expires_at, run.lease_generation
    assert not claimable_at(run, run.updated_at)
    assert not claimable_at(run, expires - MARGIN)
    assert claimable_at(run, expires)

    # Before the lease expires, nobody else may take the run: nothing is due, nothing changes.
    held = lease_of(run)
    events = run.audit_events.count()
    early = manage("run_executor", "--until-idle", at=expires - MARGIN)
    assert early.returncode == 0 and "advanced 0 run(s)" in early.stdout, early.stdout + early.stderr
    assert lease_of(run) == held
    assert run.audit_events.count() == events
    assert run.steps.get(step_name=step).state == StepState.RUNNING
    assert receivers.counts()[kind] == expected_after_crash

    # Once it has expired, another process takes the run over and finishes it.
    resumed = manage("run_executor", "--until-idle", at=expires + MARGIN)
    assert resumed.returncode == 0 and "advanced 1 run(s)" in resumed.stdout, resumed.stdout + resumed.stderr

    run.refresh_from_db()
    assert run.state == RunState.COMPLETED, run.status_reason
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
    assert all(s.remote_ref for s in run.steps.filter(step_name__in=["create_task", "notify", "post_entry"]))
    assert run.audit_events.filter(action="step_unknown", step_name=step).count() == 1
    takeover = run.audit_events.get(action="lease_takeover")  # exactly one
    assert takeover.before["lease_owner"] == crashed.owner
    assert takeover.after["lease_owner"] == resumed.owner
    assert takeover.at == expires + MARGIN
    assert run.lease_generation == dead_generation + 1  # one claim since the crash: the takeover
    assert (run.lease_owner, run.lease_expires_at) == ("", None)  # released on completion


@pytest.mark.parametrize(
    "args",
    [
        ["start_workflow", "test_orders"],  # --input missing
        ["start_workflow", "test_orders", "--input", "{oops"],
        ["start_workflow", "nope", "--input", "{}"],
        ["start_workflow", "test_orders", "--input-file", "/nonexistent/events.jsonl"],
        ["start_workflow", "test_orders", "--input-file", "-", "--batch", "0"],
        ["start_workflow", "test_orders", "--input", "{}", "--input-file", "-"],
        ["show_run", "order:none:none", "--json"],
        ["recover", "explode", "order:x:y", "--reason", "r", "--as", "olga"],
        ["run_executor", "--until-idle"],  # with a malformed RECOVERY_FAILPOINTS, below
    ],
)
def test_bad_arguments_print_one_line_on_stderr_exit_non_zero_and_write_nothing(args):
    env = {"RECOVERY_FAILPOINTS": "create_task=boom"} if args[0] == "run_executor" else {}
    result = manage(*args, **env)
    assert result.returncode != 0
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert WorkflowRun.objects.count() == 0
