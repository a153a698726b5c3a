"""The invoice workflow's fault matrix (recovery.testing): every step × every boundary × every
fault kind, over real HTTP to the simulated systems, each case checked against the invariants."""

import pytest

from recovery.testing import fault_matrix
from recovery.workflow import compensation_key
from sandbox import faults
from sandbox.models import LedgerEntry, LedgerKind, Message, MessageKind, Task, TaskStatus


@pytest.fixture
def invoice_sandbox(live_server, settings):
    settings.SANDBOX_URL = live_server.url
    faults.clear()


def invoice_effects(run) -> dict[str, int]:
    """Remote objects each writing step made for this run, counted at the receivers."""
    keys = dict(run.steps.values_list("step_name", "idempotency_key"))
    sandbox = "sandbox"
    return {
        "create_approval_task": Task.objects.using(sandbox)
        .filter(idempotency_key=keys["create_approval_task"])
        .count(),
        "notify_approver": Message.objects.using(sandbox)
        .filter(client_ref=keys["notify_approver"], kind=MessageKind.MESSAGE)
        .count(),
        "post_ledger_entry": LedgerEntry.objects.using(sandbox)
        .filter(reference=run.workflow_id, kind=LedgerKind.ENTRY)
        .count(),
    }


def invoice_compensations(run) -> dict[str, int]:
    """What each compensation made: the approval task cancelled, corrections sent, reversals posted."""
    keys = dict(run.steps.values_list("step_name", "idempotency_key"))
    sandbox = "sandbox"
    return {
        "create_approval_task": Task.objects.using(sandbox)
        .filter(idempotency_key=keys["create_approval_task"], status=TaskStatus.CANCELLED)
        .count(),
        "notify_approver": Message.objects.using(sandbox)
        .filter(client_ref=compensation_key(run.workflow_id, "notify_approver", 1), kind=MessageKind.CORRECTION)
        .count(),
        "post_ledger_entry": LedgerEntry.objects.using(sandbox)
        .filter(reverses__reference=run.workflow_id, kind=LedgerKind.REVERSAL)
        .count(),
    }


test_invoice_fault_matrix = fault_matrix(
    "invoice",
    event=lambda n: {"tenant": "matrix", "invoice_id": f"m-{n}", "text": f"Desk lamp no. {n}. Total due EUR 99.00"},
    effects=invoice_effects,
    compensations=invoice_compensations,
    fixtures=("invoice_sandbox",),
    databases=("default", "sandbox"),
)
