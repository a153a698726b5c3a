"""The dispute workflow's agent, SIGKILLed at a boundary of a model turn or a tool call in a real
worker process, then resumed by another: one credit note, one message to the customer, and the
model (an OpenAI-compatible server with function calling, in this process) asked no journaled
turn again — only the turn whose answer died with the worker, when it died after the answer.

As in test_real_crash: the dead worker's lease is long and the resuming process runs on an
engine clock pinned to just after it, read from the run's own row (no wall-clock race)."""

import json
import signal

import pytest
from django.db import connection

from recovery.engine import failpoints
from recovery.models import RunState, StepState, WorkflowRun
from sandbox.models import LedgerEntry, LedgerKind, Message
from tests.slow.conftest import MARGIN
from tests.support import rotation
from tests.support.model_server import API_KEY, function_calling
from workflows.integrations import adapters

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])]

# The journal of the dispute below, in order: every row's every boundary is a case.
JOURNAL = [
    "resolve_dispute:1",
    "resolve_dispute:1:0:look_up_invoice",
    "resolve_dispute:2",
    "resolve_dispute:2:0:issue_credit_note",
    "resolve_dispute:3",
    "resolve_dispute:3:0:notify_customer",
    "resolve_dispute:4",
]
TURNS = 4


# Every row's every boundary, in order; a run takes a share of them (tests.support.rotation: the
# in-process fault matrix sweeps them all every time). RECOVERY_CRASH_ROTATION=all runs every one.
CASES = [(row, point) for row in JOURNAL for point in failpoints.POINTS]


@pytest.mark.parametrize("row,point", rotation.chosen(CASES, connection.vendor, rotation.seed()))
def test_an_agent_killed_at_any_boundary_resumes_from_its_journal(
    row, point, sandbox_manage, live_server, settings, stub
):
    settings.SANDBOX_URL = live_server.url
    stub.answer = function_calling
    adapters.post_entry(
        reference="invoice:t42:inv-7", amount="500.00", currency="EUR", account="expenses:other", memo="inv-7"
    )
    model = {"MODEL_PROVIDER": "openai", "OPENAI_BASE_URL": stub.base_url, "OPENAI_API_KEY": API_KEY}
    event = {
        "tenant": "t42",
        "dispute_id": f"d-{row.replace(':', '-')}-{point}",
        "invoice_id": "inv-7",
        "customer": "buyer@example.com",
        "complaint": "Invoice inv-7 overcharged us by 45.00 EUR.",
    }
    started = sandbox_manage("start_workflow", "dispute", "--input", json.dumps(event))
    assert started.returncode == 0, started.stderr
    workflow_id = started.stdout.strip()

    crashed = sandbox_manage("run_executor", "--until-idle", RECOVERY_FAILPOINTS=f"{row}:{point}=crash", **model)
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
    asked_before_the_resume = len(stub.requests)
    run = WorkflowRun.objects.get(workflow_id=workflow_id)
    journaled = run.steps.filter(step_name__regex=r"^resolve_dispute:[0-9]+$", state=StepState.SUCCEEDED).count()
    if (row, point) == (JOURNAL[-1], "after_outcome"):  # the final answer completed the run, then it died
        assert run.state == RunState.COMPLETED and journaled == TURNS
    else:
        assert run.state == RunState.RUNNING and run.lease_owner == crashed.owner
        resumed = sandbox_manage("run_executor", "--until-idle", at=run.lease_expires_at + MARGIN, **model)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr

    run.refresh_from_db()
    assert run.state == RunState.COMPLETED, run.status_reason
    notes = LedgerEntry.objects.using("sandbox").filter(kind=LedgerKind.ENTRY, amount__lt=0)
    assert [str(n.amount) for n in notes] == ["-45.00"]
    assert Message.objects.using("sandbox").filter(to="buyer@example.com").count() == 1
    # The resume asked only the turns the journal did not hold: never a journaled one. A turn is
    # asked twice only when the worker died after the model answered and before it was journaled.
    assert len(stub.requests) - asked_before_the_resume == TURNS - journaled
    answer_lost = ":" not in row.removeprefix("resolve_dispute:") and point == "after_call"
    assert len(stub.requests) == TURNS + answer_lost
