"""Real crashes of the invoice workflow: an executor process is SIGKILLed at a failpoint while
talking HTTP to the simulated systems (their own database); a second process resumes. Exactly
one task, one message and one ledger entry exist afterwards."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recovery.models import RunState, WorkflowRun
from sandbox import faults
from tests.conftest import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])]

MANAGE = str(Path(__file__).resolve().parents[2] / "manage.py")
LEASE = 2


@pytest.fixture
def manage(live_server):
    faults.clear()

    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        full_env = subprocess_env(RECOVERY_LEASE_SECONDS=str(LEASE), SANDBOX_URL=live_server.url, **env)
        return subprocess.run(
            [sys.executable, MANAGE, *args], env=full_env, capture_output=True, text=True, timeout=120
        )

    yield run
    faults.clear()


@pytest.mark.parametrize(
    "failpoint",
    [
        "create_approval_task:after_call=crash",  # the tracker committed; the worker never heard
        "notify_approver:after_call=crash",  # the messenger sent; the publisher died before recording it
        "notify_approver:before_call=crash",  # the outbox row committed; the publisher died before sending
        "post_ledger_entry:after_call=crash",
    ],
)
def test_an_executor_killed_mid_invoice_is_resumed_by_another_process_with_one_of_each(manage, failpoint):
    event = {"tenant": "t1", "invoice_id": "crash-1", "text": "Laptop stand, total EUR 240.00"}
    started = manage("start_workflow", "invoice", "--input", json.dumps(event))
    assert started.returncode == 0, started.stderr
    wid = started.stdout.strip()

    crashed = manage("run_executor", "--until-idle", RECOVERY_FAILPOINTS=failpoint)
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr

    time.sleep(LEASE + 0.5)
    resumed = manage("run_executor", "--until-idle")
    assert resumed.returncode == 0, resumed.stderr
    for _ in range(20):  # the outbox and the run may each need one more pass
        if WorkflowRun.objects.get(workflow_id=wid).state == RunState.COMPLETED:
            break
        time.sleep(0.5)
        manage("run_executor", "--until-idle")

    assert WorkflowRun.objects.get(workflow_id=wid).state == RunState.COMPLETED
    counts = faults.counts()
    assert (counts["tasks"], counts["messages"], counts["ledger_entries"]) == (1, 1, 1), counts
    counted = manage("sandbox", "counts", "--json")
    assert json.loads(counted.stdout)["messages"] == 1
