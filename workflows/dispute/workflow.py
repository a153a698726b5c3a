"""A customer's invoice dispute, resolved by an agent step: the model looks the invoice up in
the ledger, decides, issues a credit note (a reversing ledger entry, compensable) and tells the
customer — each tool call with a step's recovery contract, each turn journaled.

Guards check every credit note before anything is written: it credits a posted, unreversed
invoice, in its currency, for at most its amount, and at most CREDIT_LIMIT. A refusal is answered
to the model, which escalates the dispute. A credit note above DISPUTE_CREDIT_APPROVAL_ABOVE
(settings; 500.00 by default) waits for a supervisor, who approves it, lowers it, rejects it with a
message the model reads, or answers in its place (docs/agents.md, "People in the loop")."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal
from typing import Literal

from django.conf import settings
from pydantic import BaseModel, ConfigDict, Field

from recovery.errors import PermanentError, PolicyRefusal
from recovery.workflow import Reconcile, Rerun, Workflow
from workflows.integrations import adapters
from workflows.integrations.openai import call_timeout
from workflows.integrations.policies import LEDGER_POLICY, MODEL_POLICY, READ_POLICY, WRITE_POLICY

from .agent import get_agent_provider, opening

AMOUNT = r"^(0|[1-9][0-9]{0,9})(\.[0-9]{1,2})?$"
LINK = re.compile(r"(https?://|www\.)\S+|\S+@\S+\.\w+", re.IGNORECASE)
CREDIT_LIMIT = Decimal("1000.00")  # larger credit notes are refused by the guard


class DisputeEvent(BaseModel):
    """A customer's complaint about one invoice."""

    model_config = ConfigDict(extra="allow")

    tenant: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    dispute_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    invoice_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    customer: str = Field(min_length=1, max_length=200)
    complaint: str = Field(min_length=1, max_length=20000)


class DisputeResolution(BaseModel):
    """The agent's final answer."""

    model_config = ConfigDict(extra="forbid")

    outcome: Literal["credited", "rejected", "escalated"]
    credit: str = Field(pattern=AMOUNT)
    currency: str = Field(pattern=r"^[A-Z]{3}$")
    rationale: str = Field(min_length=1, max_length=2000)


class InvoiceLookup(BaseModel):
    model_config = ConfigDict(extra="forbid")

    invoice_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")


class CreditNote(BaseModel):
    model_config = ConfigDict(extra="forbid")

    invoice_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    amount: str = Field(pattern=AMOUNT, description="the amount credited, a decimal string such as 120.00")
    reason: str = Field(min_length=1, max_length=200)


class CustomerMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1, max_length=2000)


dispute = Workflow(
    "dispute",
    version=1,
    input_schema=DisputeEvent,
    workflow_id=lambda event: f"dispute:{event['tenant']}:{event['dispute_id']}",
    description="Resolve a customer's invoice dispute with an agent: look up, credit note, message.",
    stuck_after=timedelta(minutes=15),
)


def invoice_reference(tenant: str, invoice_id: str) -> str:
    """The invoice workflow's ledger reference for an invoice (its run's workflow id)."""
    return f"invoice:{tenant}:{invoice_id}"


@dispute.step(effect="none", rerun=Rerun.YES, retry=READ_POLICY)
def read_complaint(ctx):
    return {"complaint": " ".join(ctx.input["complaint"].split())}


@dispute.tool(arguments=InvoiceLookup, effect="none", rerun=Rerun.YES, retry=READ_POLICY)
def look_up_invoice(ctx):
    """Find the invoice's ledger entry: whether it is posted, its amount, currency and account."""
    entry = adapters.ledger_entry(reference=invoice_reference(ctx.input["tenant"], ctx.intent["invoice_id"]))
    if entry is None:
        return {"found": False, "invoice_id": ctx.intent["invoice_id"]}
    return {
        "found": True,
        "invoice_id": ctx.intent["invoice_id"],
        "entry_id": entry["id"],
        "amount": entry["amount"],
        "currency": entry["currency"],
        "account": entry["account"],
        "reversed": bool(entry.get("reversed_by")),
    }


def above_approval_limit(arguments: dict, ctx) -> bool:
    """above DISPUTE_CREDIT_APPROVAL_ABOVE"""
    return Decimal(arguments["amount"]) > Decimal(settings.DISPUTE_CREDIT_APPROVAL_ABOVE)


@dispute.tool(
    arguments=CreditNote,
    effect="a credit note in the ledger (a reversing entry)",
    rerun=Rerun.NO,
    reconcile=Reconcile.LOOKUP,
    retry=LEDGER_POLICY,
    compensable=True,
    needs_approval=above_approval_limit,
    approver="supervisor",
)
def issue_credit_note(ctx):
    """Credit part or all of an invoice with a reversing ledger entry."""
    entry = adapters.ledger_entry(reference=invoice_reference(ctx.input["tenant"], ctx.intent["invoice_id"]))
    if entry is None:  # the guard saw it a moment ago: for an operator
        raise PermanentError(f"invoice {ctx.intent['invoice_id']}: its ledger entry is gone")
    return adapters.post_entry(
        reference=ctx.idempotency_key,  # the call's own key: a repeat is refused by the ledger, found by look-up
        amount=str(-Decimal(ctx.intent["amount"])),
        currency=entry["currency"],
        account=entry["account"],
        memo=f"credit note for invoice {ctx.intent['invoice_id']}: {ctx.intent['reason']}",
    )


@issue_credit_note.lookup
def _(ctx):
    return adapters.find_entry(reference=ctx.idempotency_key)


@issue_credit_note.lookup_ref
def _(ctx, entry_id):
    """An operator's "it succeeded, entry X": X must be the credit note posted under this call's key."""
    entry = adapters.own(adapters.get_entry(entry_id=entry_id), reference=ctx.idempotency_key)
    return adapters.entry_outcome(entry) if entry else None


@issue_credit_note.compensate(who="supervisor", description="reverse the credit note (a reversing entry)")
def _(ctx):
    return adapters.reverse_entry(
        entry_id=ctx.intent["remote_ref"], reference=ctx.idempotency_key, memo="credit note withdrawn"
    )


@issue_credit_note.guard("credit_within_invoice")
def _(ctx):
    """The invoice is posted and not reversed, and the credit is at most its amount."""
    entry = adapters.ledger_entry(reference=invoice_reference(ctx.input["tenant"], ctx.intent["invoice_id"]))
    asked = Decimal(ctx.intent["amount"])
    if entry is None:
        raise PolicyRefusal("credit_within_invoice", "the invoice is not posted", dict(ctx.intent))
    if entry.get("reversed_by"):
        raise PolicyRefusal("credit_within_invoice", f"{entry['id']} is already reversed", dict(ctx.intent))
    if not Decimal(0) < asked <= Decimal(entry["amount"]):
        raise PolicyRefusal(
            "credit_within_invoice",
            f"a credit of {asked} on an invoice of {entry['amount']} {entry['currency']}",
            {**ctx.intent, "invoice_amount": entry["amount"]},
        )


@issue_credit_note.guard("credit_limit")
def _(ctx):
    """A credit note above the limit needs a person."""
    if Decimal(ctx.intent["amount"]) > CREDIT_LIMIT:
        raise PolicyRefusal("credit_limit", f"{ctx.intent['amount']} is over the {CREDIT_LIMIT} limit", {**ctx.intent})


@dispute.tool(
    arguments=CustomerMessage,
    effect="a message to the customer",
    rerun=Rerun.NO,
    reconcile=Reconcile.LOOKUP,
    retry=WRITE_POLICY,
)
def notify_customer(ctx):
    """Send the customer one message about their dispute."""
    return adapters.send_message(to=ctx.input["customer"], text=ctx.intent["text"], client_ref=ctx.idempotency_key)


@notify_customer.lookup
def _(ctx):
    return adapters.find_message(client_ref=ctx.idempotency_key)


@notify_customer.lookup_ref
def _(ctx, message_id):
    """An operator's "it succeeded, message X": X must be the message sent under this call's key."""
    message = adapters.own(adapters.get_message(message_id=message_id), client_ref=ctx.idempotency_key)
    return adapters.message_outcome(message) if message else None


@notify_customer.guard("no_links")
def _(ctx):
    """The message carries no link or address to follow: a complaint cannot make the agent send one."""
    found = LINK.search(ctx.intent["text"])
    if found:
        raise PolicyRefusal("no_links", f"the message contains {found.group(0)!r}", {"text": ctx.intent["text"]})


@dispute.agent(
    tools=[look_up_invoice, issue_credit_note, notify_customer],
    schema=DisputeResolution,
    max_turns=6,
    argument_errors=2,
    retry=MODEL_POLICY,
    timeout=call_timeout,
)
def resolve_dispute(ctx):
    """Ask the model for the next turn of the dispute's conversation."""
    messages = opening(ctx.input, ctx.result("read_complaint")["complaint"]) + ctx.messages
    return get_agent_provider().chat(messages=messages, tools=ctx.tools, about=f"dispute_id={ctx.input['dispute_id']}")
