"""Real crashes of the invoice workflow: an executor process is SIGKILLed at a failpoint while
talking HTTP to the simulated systems (their own database); a second process resumes. Exactly
one task, one message and one ledger entry exist afterwards.

No assertion races the wall clock: the dead executor's lease (on the run, or its claim on an
outbox message) is long (conftest.LEASE), and every process after the crash runs on an engine
clock pinned to instants read from the database: one second before the lease expires (nobody
may take what it held), one second after (the takeover), then each time the run is due next."""

import json
import signal
from datetime import timedelta

import pytest

from recovery.engine.transitions import claimable, outbox_due
from recovery.models import OutboxMessage, OutboxState, RunState, StepState, WorkflowRun
from sandbox import faults
from tests.slow.conftest import LEASE, MARGIN

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])]

KIND = {"create_approval_task": "tasks", "notify_approver": "messages", "post_ledger_entry": "ledger_entries"}
OUTBOX_STEP = "notify_approver"
PASSES = 20


@pytest.fixture
def manage(sandbox_manage):
    return sandbox_manage


def crash(manage, wid: str, failpoint: str):
    """Run an executor with the failpoint armed until it dies there. A call that outlasts the
    HTTP timeout (a loaded machine) schedules a retry before the failpoint is reached: the next
    executor's clock is pinned to that retry's time instead of waiting for it."""
    at = None
    for _ in range(PASSES):
        crashed = manage("run_executor", "--until-idle", at=at, RECOVERY_FAILPOINTS=failpoint)
        if crashed.returncode != 0:
            break
        run = WorkflowRun.objects.get(workflow_id=wid)
        assert run.state == RunState.WAITING and run.next_wake_at is not None, (run.state, run.status_reason)
        at = max(run.next_wake_at, at or run.next_wake_at)
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
    return crashed


def held_by_dead_executor(run: WorkflowRun, holder: str, step: str, owner: str):
    """Check what the dead executor still holds, as it last wrote it: its own lease, LEASE
    seconds from that write, not claimable a moment before it expires and claimable at once.
    Returns when it expires and a snapshot of it that nobody may change until then."""
    if holder == "run":
        assert run.state == RunState.RUNNING
        assert run.steps.get(step_name=step).state == StepState.RUNNING
        assert run.lease_owner == owner
        assert run.lease_expires_at == run.updated_at + timedelta(seconds=LEASE)
        expires = run.lease_expires_at
        held = WorkflowRun.objects.filter(pk=run.pk)
        due = held.filter(claimable(expires - MARGIN)), held.filter(claimable(expires))
        # (not its revision: delivering an outbox message saves the run without taking it)
        fields = ["state", "lease_owner", "lease_generation", "lease_expires_at"]
    else:
        message = OutboxMessage.objects.get(run=run, step_name=step)
        assert message.state == OutboxState.PENDING
        assert message.claimed_by == owner
        assert message.claimed_until == message.updated_at + timedelta(seconds=LEASE)
        expires = message.claimed_until
        held = OutboxMessage.objects.filter(pk=message.pk)
        due = held.filter(outbox_due(expires - MARGIN)), held.filter(outbox_due(expires))
        fields = ["state", "attempts", "claimed_by", "claimed_until", "claim_generation", "updated_at"]
    assert not due[0].exists()
    assert due[1].exists()
    return expires, lambda: list(held.values_list(*fields))


@pytest.mark.parametrize(
    "failpoint,holder",
    [
        ("create_approval_task:after_call=crash", "run"),  # the tracker committed; the worker never heard
        ("notify_approver:after_call=crash", "outbox"),  # the messenger sent; the publisher died before recording it
        ("notify_approver:before_call=crash", "outbox"),  # the outbox row committed; the publisher died before sending
        ("post_ledger_entry:after_call=crash", "run"),
    ],
)
def test_an_executor_killed_mid_invoice_is_resumed_by_another_process_with_one_of_each(manage, failpoint, holder):
    event = {"tenant": "t1", "invoice_id": "crash-1", "text": "Laptop stand, total EUR 240.00"}
    started = manage("start_workflow", "invoice", "--input", json.dumps(event))
    assert started.returncode == 0, started.stderr
    wid = started.stdout.strip()
    step = failpoint.split(":")[0]

    crashed = crash(manage, wid, failpoint)
    run = WorkflowRun.objects.get(workflow_id=wid)
    expires, snapshot = held_by_dead_executor(run, holder, step, crashed.owner)
    held = snapshot()
    after_crash = faults.counts()[KIND[step]]

    # Before the lease expires, another executor may not take what the dead one held.
    early = manage("run_executor", "--until-idle", at=expires - MARGIN)
    assert early.returncode == 0, early.stdout + early.stderr
    assert snapshot() == held
    assert faults.counts()[KIND[step]] == after_crash
    assert not run.audit_events.filter(action="lease_takeover").exists()

    # Once it has expired, executors take over; each next one runs when the run is due next.
    at = expires + MARGIN
    for _ in range(PASSES):
        resumed = manage("run_executor", "--until-idle", at=at)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        run.refresh_from_db()
        if run.state != RunState.WAITING:
            break
        retries = OutboxMessage.objects.filter(run=run, state=OutboxState.PENDING).values_list("next_attempt_at")
        at = max([at + MARGIN, run.next_wake_at, *(t for (t,) in retries if t is not None)])

    assert run.state == RunState.COMPLETED, (run.state, run.status_reason)
    counts = faults.counts()
    assert (counts["tasks"], counts["messages"], counts["ledger_entries"]) == (1, 1, 1), counts
    assert (counts["tasks_cancelled"], counts["corrections"], counts["ledger_reversals"]) == (0, 0, 0), counts
    counted = manage("sandbox", "counts", "--json")
    assert json.loads(counted.stdout)["messages"] == 1

    message = OutboxMessage.objects.get(run=run, step_name=OUTBOX_STEP)
    assert message.state == OutboxState.DELIVERED
    delivered = run.audit_events.get(action="outbox_delivered")  # exactly one
    takeovers = run.audit_events.filter(action="lease_takeover")
    if holder == "run":
        # The run was taken from the dead executor, once, and only after its lease expired.
        takeover = takeovers.get()
        assert takeover.before["lease_owner"] == crashed.owner
        assert takeover.at == expires + MARGIN
        assert run.audit_events.filter(action="step_unknown", step_name=step).count() == 1
    else:
        # The dead publisher had let go of the run; its message was attempted again only after
        # its claim expired.
        assert not takeovers.exists()
        assert message.attempts >= 2
        assert message.delivered_at >= expires + MARGIN
        assert delivered.at == message.delivered_at
    assert (run.lease_owner, run.lease_expires_at) == ("", None)  # released on completion
