"""A real crash: a worker process is SIGKILLed at a failpoint; a second process resumes.

SPEC §4.1 and §4.2 with real processes: the receiver's commit survives in its own
transaction, the dead worker's step is found `running` past its lease, treated as unknown,
reconciled, and exactly one remote object exists.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recovery.models import RunState, StepState, WorkflowRun
from tests.conftest import subprocess_env
from tests.support import receivers

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MANAGE = str(Path(__file__).resolve().parents[2] / "manage.py")
LEASE = 2


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, MANAGE, *args],
        env=subprocess_env(RECOVERY_LEASE_SECONDS=str(LEASE), **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


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
    kind = {"create_task": "task", "notify": "message", "post_entry": "ledger"}[step]
    assert receivers.counts()[kind] == expected_after_crash

    # Before the lease expires, nobody else may take the run: nothing is due.
    early = manage("run_executor", "--until-idle")
    assert early.returncode == 0 and "advanced 0 run" in early.stdout
    time.sleep(LEASE + 0.5)
    resumed = manage("run_executor", "--until-idle")
    assert resumed.returncode == 0, resumed.stderr

    run.refresh_from_db()
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
    assert all(s.remote_ref for s in run.steps.filter(step_name__in=["create_task", "notify", "post_entry"]))
    assert run.audit_events.filter(action="lease_takeover").count() == 1
    assert run.audit_events.filter(action="step_unknown", step_name=step).count() == 1


@pytest.mark.parametrize(
    "args",
    [
        ["start_workflow", "test_orders"],  # --input missing
        ["start_workflow", "test_orders", "--input", "{oops"],
        ["start_workflow", "nope", "--input", "{}"],
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
