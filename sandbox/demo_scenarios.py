"""The demo's stories: which invoices and disputes ``seed_demo`` plays, on which version of
the workflow, how (``play``: the ``demo_player.Seeder`` method that plays it) and the state each
run must end in. Data only; the player plays them, ``demo_seed`` decides which and when."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recovery.models import RunState
from recovery.workflow import Workflow, get_workflow

# The demo model's scripted answers (MODEL_PROVIDER=scripted): the off-schema invoices, and the
# invoice whose approver the model gets wrong (the approval policy's guard stops it).
MODEL_SCRIPT = Path(__file__).resolve().parent / "demo_model_script.json"

# What each way of playing a scenario leaves the run in.
OUTCOMES = {
    "plain": RunState.COMPLETED,
    "task_answer_lost": RunState.COMPLETED,
    "ledger_unavailable_once": RunState.COMPLETED,
    "message_answer_lost": RunState.COMPLETED,
    "compensated": RunState.COMPENSATED,
    "unknown_outcome": RunState.NEEDS_REVIEW,
    "task_forbidden": RunState.FAILED,
    "model_off_schema": RunState.NEEDS_REVIEW,
    "model_wrong_approver": RunState.NEEDS_REVIEW,
    "compensation_fails": RunState.COMPENSATION_FAILED,
    "message_forbidden": RunState.NEEDS_REVIEW,
    "ledger_rate_limited": RunState.WAITING,
    "ledger_forbidden": RunState.FAILED,
}
# Played on the real clock: its retry time must stay in the future.
LIVE = frozenset({"ledger_rate_limited"})


def invoice_id(base: str, generation: int) -> str:
    """The demo's invoice ids: as written for the first generation, ``-r2``, ``-r3`` … after each reset."""
    return base if generation == 1 else f"{base}-r{generation}"


@dataclass(frozen=True)
class Scenario:
    tenant: str
    invoice_id: str
    vendor: str
    items: str
    total: str
    play: str  # the Seeder method that plays it
    version: int | None = None  # the invoice workflow's version it starts on (None: the current one)

    def event(self, generation: int = 1) -> dict[str, Any]:
        text = f"{self.vendor} — {self.items}. Total due: {self.total}"
        return {
            "tenant": self.tenant,
            "invoice_id": invoice_id(self.invoice_id, generation),
            "vendor": self.vendor,
            "text": text,
        }

    def workflow(self) -> Workflow:
        return get_workflow("invoice", self.version)


# The first two started on invoice v1, before v2 (and its duplicate check) was deployed; v1 is
# kept beside v2 and v3 until its runs drain. HL-887 stopped before its approval task: a supervisor may
# move it to v2. SI-7779 is past its approval task (step 3 of v1, step 4 of v2): it cannot move.
# When workflows/invoice/v1.py goes, these two go with it (get_workflow would refuse version 1).
# fmt: off
SCENARIOS = (
    Scenario("hooli", "HL-887", "Hooli Cleaning", "deep cleaning after the office move", "EUR 1,260.00",
             "model_off_schema", version=1),
    Scenario("stark", "SI-7779", "Stark Legal", "review of the office lease, 9 hours", "USD 3,150.00",
             "ledger_forbidden", version=1),
    Scenario("acme", "INV-1001", "ACME Office Supply", "40 ergonomic chairs and 10 desks", "EUR 1,840.00", "plain"),
    Scenario("globex", "GX-2024-117", "Globex Software", "annual licence, 25 seats", "USD 7,450.00",
             "task_answer_lost"),
    Scenario("initech", "IN-5531", "Initech Hardware", "12 laptops and 12 monitors", "EUR 18,960.00",
             "ledger_unavailable_once"),
    Scenario("umbrella", "UMB-0042", "Umbrella Travel", "flights and hotel, Berlin sales summit", "GBP 2,310.50",
             "message_answer_lost"),
    Scenario("hooli", "HL-889", "Hooli Cleaning", "monthly office cleaning, March", "EUR 980.00", "plain"),
    Scenario("stark", "SI-7781", "Stark Legal", "consulting on supplier contracts, 32 hours", "USD 12,400.00",
             "compensated"),
    Scenario("acme", "INV-1002", "ACME Office Supply", "6 standing desks and 2 chairs", "EUR 3,270.00",
             "unknown_outcome"),
    Scenario("globex", "GX-2024-118", "Globex Software", "SaaS subscription renewal, 12 months", "USD 2,400.00",
             "task_forbidden"),
    Scenario("initech", "IN-5532", "Initech", "taxi receipts for the client visit in Lyon", "EUR 146.80",
             "model_off_schema"),
    Scenario("umbrella", "UMB-0043", "Umbrella Hardware", "4 monitors for the support team", "GBP 1,196.00",
             "compensation_fails"),
    Scenario("soylent", "SC-104", "Soylent Catering", "lunch for the quarterly review, 45 people", "EUR 640.00",
             "message_forbidden"),
    Scenario("wayne", "WE-3302", "Wayne Paper Co", "200 reams of paper and 30 toner cartridges", "EUR 1,125.40",
             "ledger_rate_limited"),
    Scenario("globex", "GX-2024-119", "Globex Hardware", "8 laptops for the new analysts", "EUR 14,200.00",
             "model_wrong_approver"),
)
# fmt: on


@dataclass(frozen=True)
class Dispute:
    """A customer's dispute about one of the demo invoices, resolved by the dispute workflow's
    agent (played after the invoices, whose ledger entries it looks up)."""

    tenant: str
    dispute_id: str
    invoice_id: str  # a scenario's, above
    customer: str
    complaint: str
    play: str

    def event(self, generation: int = 1) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "dispute_id": invoice_id(self.dispute_id, generation),
            "invoice_id": invoice_id(self.invoice_id, generation),
            "customer": self.customer,
            "complaint": self.complaint,
        }


# fmt: off
DISPUTES = (
    Dispute("acme", "D-501", "INV-1001", "ap@acme.example",
            "Invoice INV-1001 overcharged us by 120.00 EUR: two chairs arrived damaged and went back.", "plain"),
    Dispute("initech", "D-502", "IN-5531", "finance@initech.example",
            "You charged us twice for invoice IN-5531.", "plain"),
    Dispute("hooli", "D-503", "HL-889", "office@hooli.example",
            "Invoice HL-889 overcharged us by 80.00 EUR: the windows were not cleaned.", "dispute_stopped"),
    Dispute("globex", "D-504", "GX-2024-117", "ap@globex.example",
            "Invoice GX-2024-117 overcharged us by 600.00 USD: 5 of the 25 seats were never activated.",
            "dispute_held"),
)
# fmt: on
DISPUTE_OUTCOMES = {
    "D-501": RunState.COMPLETED,
    "D-502": RunState.COMPLETED,
    "D-503": RunState.NEEDS_REVIEW,
    "D-504": RunState.WAITING,  # its credit note (above DISPUTE_CREDIT_APPROVAL_ABOVE) waits for a supervisor
}


def generation_ids(generation: int) -> list[str]:
    """The workflow ids of the demo's invoice runs in ``generation``, in ``SCENARIOS``' order."""
    return [s.workflow().workflow_id(s.workflow().validate_input(s.event(generation))) for s in SCENARIOS]


def dispute_ids(generation: int) -> list[str]:
    workflow = get_workflow("dispute")
    return [workflow.workflow_id(workflow.validate_input(d.event(generation))) for d in DISPUTES]
