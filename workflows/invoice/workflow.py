"""The seed's invoice workflow, v3: read → classify → check for a duplicate → create approval
task → notify approver → watch the task → wait for the approver's decision → post ledger entry,
with its recovery contract (the contract table) and its guards: the model proposes, and before
anything is written the proposal must match what the invoice itself says (amount, currency), the
approval policy (approver, category), the ledger's current state, and no open approval task of
another invoice may claim the same sum. An invoice above INVOICE_APPROVAL_WAIT_ABOVE (settings)
is posted only once its approver approved the task in the tracker, which calls the run back
(a durable wait: no worker held); a rejection posts nothing and stops the run for review. v2
(without the approver's decision) and v1 (without the duplicate check either) are kept in
``v2.py`` and ``v1.py`` until their runs have drained."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from decimal import Decimal

from django.conf import settings
from pydantic import BaseModel, ConfigDict, Field

from recovery.errors import PolicyRefusal
from recovery.workflow import CompensationPolicy, OnTimeout, PauseAfter, Reconcile, Rerun, Workflow
from workflows.integrations import adapters
from workflows.integrations.openai import call_timeout
from workflows.integrations.policies import LEDGER_POLICY, MODEL_POLICY, READ_POLICY, WRITE_POLICY

from .model import SCHEMA_VERSION, InvoiceDecision, get_provider
from .policy import APPROVAL_POLICY, invoice_total


class LedgerPosting(BaseModel):
    """What ``post_ledger_entry`` sends: a supervisor's corrected posting is checked by it."""

    model_config = ConfigDict(extra="forbid")

    reference: str = Field(min_length=1, max_length=255)
    amount: str = Field(pattern=r"^[0-9]{1,12}\.[0-9]{2}$")
    currency: str = Field(pattern=r"^[A-Z]{3}$")
    account: str = Field(pattern=r"^expenses:[a-z_]{1,40}$")
    memo: str = Field(min_length=1, max_length=500)


class InvoiceEvent(BaseModel):
    """The business event that starts a run. Extra fields (vendor, due date, …) are kept."""

    model_config = ConfigDict(extra="allow")

    tenant: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    invoice_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    text: str = Field(min_length=1, max_length=20000)


invoice = Workflow(
    "invoice",
    version=3,
    input_schema=InvoiceEvent,
    workflow_id=lambda event: f"invoice:{event['tenant']}:{event['invoice_id']}",
    description="Classify a supplier invoice, open an approval task, notify the approver, post the ledger entry.",
    compensation=CompensationPolicy.OPERATOR,
    # An invoice stuck for a quarter of an hour (waiting for a person, or in trouble) raises an alert.
    stuck_after=timedelta(minutes=15),
)


@invoice.step(effect="none", rerun=Rerun.YES, retry=READ_POLICY)
def read_invoice(ctx):
    text = " ".join(ctx.input["text"].split())
    return {"text": text, "characters": len(text)}


@invoice.decision(schema=InvoiceDecision, schema_version=SCHEMA_VERSION, retry=MODEL_POLICY, timeout=call_timeout)
def classify(ctx):
    return get_provider().propose(invoice_id=ctx.intent["invoice_id"], text=ctx.intent["text"])


@classify.intent
def _(ctx):
    return {"invoice_id": ctx.input["invoice_id"], "text": ctx.result("read_invoice")["text"]}


@invoice.step(effect="none", rerun=Rerun.YES, retry=READ_POLICY)
def check_duplicate(ctx):
    """Ask the tracker for open approval tasks of other invoices of this tenant with the
    decided amount and currency: the same bill sent twice under two numbers (new in v2)."""
    return duplicates(ctx.input, ctx.result("classify"))


def duplicates(event: dict, decision: dict) -> dict:
    """What the tracker holds open for the same tenant, amount and currency under another
    invoice id: ``{"duplicate_of": [invoice ids], "tasks": [task ids], "amount", "currency"}``
    (empty lists when none), the amount and currency being those asked about."""
    amount = _cents(decision["amount"])
    found = adapters.find_open_tasks(tenant=event["tenant"], amount=amount, currency=decision["currency"])
    others = [task for task in found if task["invoice_id"] != event["invoice_id"]]
    return {
        "duplicate_of": sorted({task["invoice_id"] or task["task_id"] for task in others}),
        "tasks": [task["task_id"] for task in others],
        "amount": amount,
        "currency": decision["currency"],
    }


# --- guards: checked before every write that acts on the decision -------------------------


@invoice.guard("amount_matches_invoice")
def _(ctx):
    """The amount and currency are the ones the invoice text states (parsed, not asked)."""
    stated = invoice_total(ctx.result("read_invoice")["text"])
    proposed = {"amount": ctx.decision["amount"], "currency": ctx.decision["currency"]}
    if stated is None:
        raise PolicyRefusal("amount_matches_invoice", "no amount can be read from the invoice text", proposed)
    if Decimal(str(ctx.decision["amount"])) != stated.amount or ctx.decision["currency"] != stated.currency:
        raise PolicyRefusal(
            "amount_matches_invoice",
            f"the invoice states {stated.amount} {stated.currency}, the decision says "
            f"{ctx.decision['amount']} {ctx.decision['currency']}",
            {**proposed, "invoice_amount": str(stated.amount), "invoice_currency": stated.currency},
        )


@invoice.guard("approval_policy")
def _(ctx):
    """The category is one the policy knows and the approver the one it assigns."""
    category, approver = ctx.decision["category"], ctx.decision["approver"]
    if category not in APPROVAL_POLICY.categories:
        raise PolicyRefusal("approval_policy", f"unknown category {category!r}", {"category": category})
    assigned = APPROVAL_POLICY.approver_for(category=category, amount=Decimal(str(ctx.decision["amount"])))
    if approver != assigned:
        raise PolicyRefusal(
            "approval_policy",
            f"{approver} is not the approver for {category} at {ctx.decision['amount']}: the policy assigns {assigned}",
            {"proposed_approver": approver, "policy_approver": assigned, "category": category},
        )


@invoice.step(
    effect="a new approval task in the task tracker",
    rerun=Rerun.NO,
    reconcile=Reconcile.LOOKUP,
    retry=WRITE_POLICY,
    compensable=True,
)
def create_approval_task(ctx):
    return adapters.create_task(key=ctx.idempotency_key, **ctx.intent)


@create_approval_task.intent
def _(ctx):
    decision = ctx.result("classify")
    return {
        "title": f"Approve invoice {ctx.input['invoice_id']}: {decision['amount']} {decision['currency']}",
        "assignee": decision["approver"],
        "payload": {
            "tenant": ctx.input["tenant"],
            "invoice_id": ctx.input["invoice_id"],
            "category": decision["category"],
            "amount": decision["amount"],
            "currency": decision["currency"],
        },
    }


@create_approval_task.lookup
def _(ctx):
    return adapters.find_task(key=ctx.idempotency_key)


@create_approval_task.lookup_ref
def _(ctx, task_id):
    """An operator's "it succeeded, task X": X must be the task this step's key created."""
    task = adapters.own(adapters.get_task(task_id=task_id), idempotency_key=ctx.idempotency_key)
    return adapters.task_outcome(task) if task else None


@create_approval_task.guard("invoice_open_in_ledger")
def _(ctx):
    """The invoice is neither posted nor cancelled in the ledger yet (read fresh), under the
    reference its posting would be made with."""
    state = adapters.ledger_state(reference=ledger_reference(ctx))
    if state:
        raise PolicyRefusal(
            "invoice_open_in_ledger", f"invoice {ctx.input['invoice_id']} is {state}", {"ledger": state}
        )


@create_approval_task.guard("not_a_duplicate")
def _(ctx):
    """No approval task is open for another invoice of this tenant with the same amount and
    currency, as ``check_duplicate`` found (asked again if the decision changed since the check).
    A v1 run has no ``check_duplicate`` result (``ctx.results.get("check_duplicate")`` is None):
    the guard passes, as v1 never checked."""
    checked = ctx.results.get("check_duplicate")
    if checked is None:
        return
    if (checked["amount"], checked["currency"]) != (_cents(ctx.decision["amount"]), ctx.decision["currency"]):
        checked = duplicates(ctx.input, ctx.decision)
    if checked["duplicate_of"]:
        raise PolicyRefusal(
            "not_a_duplicate",
            f"invoice {ctx.input['invoice_id']} may duplicate {', '.join(checked['duplicate_of'])}: an approval "
            f"task ({', '.join(checked['tasks'])}) is open for {checked['amount']} {checked['currency']} "
            f"of {ctx.input['tenant']}",
            {key: checked[key] for key in ("duplicate_of", "tasks", "amount", "currency")},
        )


def _cents(amount) -> str:
    return str(Decimal(str(amount)).quantize(Decimal("0.01")))


@create_approval_task.compensate(who="supervisor")
def cancel_approval_task(ctx):
    """Cancel the approval task with a reason."""
    return adapters.cancel_task(task_id=ctx.intent["remote_ref"], reason=f"invoice {ctx.input['invoice_id']} withdrawn")


@invoice.step(
    effect="a message to the approver, through the transactional outbox",
    rerun=Rerun.NO,
    reconcile=Reconcile.LOOKUP,
    retry=WRITE_POLICY,
    compensable=True,
    outbox=True,
    # A restart from an earlier step may let the first message stand (a supervisor's choice).
    second_effect="a second message goes to the approver; the first stands",
)
def notify_approver(ctx):
    return adapters.send_message(client_ref=ctx.idempotency_key, **ctx.intent)


@notify_approver.intent
def _(ctx):
    decision = ctx.result("classify")
    task = ctx.result("create_approval_task")
    return {
        "to": decision["approver"],
        "text": (
            f"Invoice {ctx.input['invoice_id']} ({decision['amount']} {decision['currency']}, {decision['category']}) "
            f"awaits your approval: task {task['task_id']}."
        ),
    }


@notify_approver.lookup
def _(ctx):
    return adapters.find_message(client_ref=ctx.idempotency_key)


@notify_approver.lookup_ref
def _(ctx, message_id):
    """An operator's "it succeeded, message X": X must be the message sent under this step's key."""
    message = adapters.own(adapters.get_message(message_id=message_id), client_ref=ctx.idempotency_key, kind="message")
    return adapters.message_outcome(message) if message else None


@notify_approver.compensate(who="operator")
def send_correction(ctx):
    """Send a correction to the approver and mark the incident."""
    sent = adapters.send_correction(
        message_id=ctx.intent["remote_ref"],
        client_ref=ctx.idempotency_key,
        text=f"Correction: disregard the approval request for invoice {ctx.input['invoice_id']}.",
    )
    incident = f"approver notified in error ({ctx.intent['remote_ref']}); correction {sent.remote_ref} sent"
    return replace(sent, incident=incident)


class TaskDecision(BaseModel):
    """The tracker's callback when the approval task is decided (the event ``task_decided``)."""

    model_config = ConfigDict(extra="forbid")

    task: str = Field(min_length=1, max_length=64)
    decision: str = Field(pattern="^(approved|rejected)$")
    by: str = Field(min_length=1, max_length=200)
    note: str = Field(default="", max_length=2000)


def approver_decides(ctx) -> bool:
    """above INVOICE_APPROVAL_WAIT_ABOVE"""
    amount = Decimal(str(ctx.result("classify")["amount"]))
    return amount > Decimal(settings.INVOICE_APPROVAL_WAIT_ABOVE)


@invoice.step(
    effect="asks the tracker to call the run back when its approval task is decided",
    rerun=Rerun.YES,
    retry=WRITE_POLICY,
)
def watch_approval_task(ctx):
    """Only for an invoice whose approver decides before it is posted (``approver_decides``)."""
    if not approver_decides(ctx):
        return {"watching": False}
    events = f"{settings.RECOVERY_CONSOLE_URL}/api/runs/{ctx.workflow_id}/events"
    return adapters.watch_task(task_id=ctx.result("create_approval_task")["task_id"], callback_url=events)


@invoice.wait(
    event="task_decided",
    timeout=timedelta(days=7),
    on_timeout=OnTimeout.escalate("supervisor", timeout=timedelta(days=2)),
    schema=TaskDecision,
    when=approver_decides,
)
def approver_decision(ctx):
    """The approver's decision in the tracker, as it called the run back (or none needed)."""
    return ctx.event if ctx.event is not None else {"decision": "not needed"}


@invoice.step(
    effect="a financial record in the ledger",
    rerun=Rerun.NO,
    reconcile=Reconcile.LOOKUP,
    retry=LEDGER_POLICY,
    compensable=True,
    # A ledger that keeps failing (five failures of one kind in two minutes, across the runs):
    # the step pauses itself for every run, before one spends its six attempts into review.
    pause_after=PauseAfter(failures=5, within=timedelta(minutes=2)),
    intent_schema=LedgerPosting,
)
def post_ledger_entry(ctx):
    return adapters.post_entry(**ctx.intent)


def ledger_reference(ctx) -> str:
    """The posting's transaction reference: the run's identity, never an attempt's. A restart
    that makes the posting again (after reversing the first) gives it a new key version, and
    the new posting its own reference (``invoice:acme:inv-1:v2``)."""
    version = ctx.key_version("post_ledger_entry")
    return ctx.workflow_id if version == 1 else f"{ctx.workflow_id}:v{version}"


@post_ledger_entry.intent
def _(ctx):
    decision = ctx.result("classify")
    return {
        # A stable transaction reference, from the run's identity: never from an attempt.
        "reference": ledger_reference(ctx),
        "amount": str(Decimal(str(decision["amount"])).quantize(Decimal("0.01"))),
        "currency": decision["currency"],
        "account": f"expenses:{decision['category']}",
        "memo": f"invoice {ctx.input['invoice_id']} ({ctx.input['tenant']})",
    }


@post_ledger_entry.guard("approved_by_approver")
def _(ctx):
    """Where the approver decides (v3, above INVOICE_APPROVAL_WAIT_ABOVE), only an approved task is posted."""
    decided = ctx.results.get("approver_decision") or {}
    if decided.get("decision") == "rejected":
        said = f"task {decided['task']} was rejected by {decided['by']}"
        raise PolicyRefusal("approved_by_approver", f"{said}: {decided.get('note') or 'no note'}", dict(decided))


@post_ledger_entry.lookup
def _(ctx):
    return adapters.find_entry(reference=ledger_reference(ctx))


@post_ledger_entry.lookup_ref
def _(ctx, entry_id):
    """An operator's "it succeeded, entry X": X must be this run's posting (its reference)."""
    entry = adapters.own(adapters.get_entry(entry_id=entry_id), reference=ledger_reference(ctx), kind="entry")
    return adapters.entry_outcome(entry) if entry else None


@post_ledger_entry.compensate(who="supervisor")
def post_reversal(ctx):
    """Post a reversing ledger entry (never delete)."""
    return adapters.reverse_entry(
        entry_id=ctx.intent["remote_ref"],
        reference=f"{ledger_reference(ctx)}:reversal",
        memo=f"reversal of invoice {ctx.input['invoice_id']}",
    )
