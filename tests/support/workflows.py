"""A test workflow exercising every recovery path, with counting receivers.

read -> decide (model) -> create_task (receiver honours keys: resend) ->
notify (receiver does not: look up by client reference) -> post_entry (unique reference: look up).
"""

import logging
from datetime import timedelta

from django.conf import settings
from pydantic import BaseModel, ConfigDict, Field

from recovery.retries import RetryPolicy
from recovery.workflow import Outcome, PolicyRefusal, Reconcile, Rerun, Workflow

from . import receivers
from .models import RemoteObject


class Event(BaseModel):
    tenant: str
    order_id: str
    text: str = "office chairs 120"


class Decision(BaseModel):
    category: str = Field(pattern="^(office|travel)$")
    amount: int = Field(ge=0)
    approver: str


FAST = RetryPolicy(
    initial_interval=1,
    backoff_coefficient=2,
    maximum_interval=30,
    maximum_attempts=4,
    maximum_elapsed=600,
    jitter=0.1,
    maximum_format_failures=2,
)

orders = Workflow(
    "test_orders",
    version=1,
    input_schema=Event,
    workflow_id=lambda i: f"order:{i['tenant']}:{i['order_id']}",
    description="engine test workflow",
    # An alert when a run waits for review over 10 minutes, or is stuck for any other cause an hour.
    stuck_after={"needs_review": timedelta(minutes=10), "any": timedelta(hours=1)},
)


@orders.step(effect="none", rerun=Rerun.YES, retry=FAST)
def read(ctx):
    return {"text": ctx.input["text"].strip()}


@orders.decision(schema=Decision, retry=FAST)
def decide(ctx):
    return receivers.model_propose(ctx.intent["text"])


@decide.intent
def _(ctx):
    return {"text": ctx.result("read")["text"]}


@orders.step(
    effect="a new task in the tracker", rerun=Rerun.NO, reconcile=Reconcile.RESEND, retry=FAST, compensable=True
)
def create_task(ctx):
    return receivers.create_task(key=ctx.idempotency_key, payload=ctx.intent)


@create_task.intent
def _(ctx):
    d = ctx.result("decide")
    return {"title": f"Approve {ctx.input['order_id']}", "approver": d["approver"], "amount": d["amount"]}


@orders.step(
    effect="a message to the approver", rerun=Rerun.NO, reconcile=Reconcile.LOOKUP, retry=FAST, compensable=True
)
def notify(ctx):
    return receivers.send_message(client_ref=ctx.idempotency_key, payload=ctx.intent)


@notify.intent
def _(ctx):
    return {"to": ctx.result("decide")["approver"], "task": ctx.result("create_task")["task_id"]}


@notify.lookup
def _(ctx):
    return receivers.find_message(client_ref=ctx.idempotency_key)


@create_task.lookup_ref
def _(ctx, ref):
    return receivers.by_ref("task", ref, mine={"dedupe_key": ctx.idempotency_key})


@notify.lookup_ref
def _(ctx, ref):
    return receivers.by_ref("message", ref, mine={"client_ref": ctx.idempotency_key})


@orders.step(effect="a ledger entry", rerun=Rerun.NO, reconcile=Reconcile.LOOKUP, retry=FAST, compensable=True)
def post_entry(ctx):
    return receivers.post_entry(reference=reference(ctx), payload=ctx.intent)


def reference(ctx) -> str:
    """The ledger's own reference: the run's id, and a new one for a posting a restart makes again."""
    version = ctx.key_version("post_entry")
    return ctx.workflow_id if version == 1 else f"{ctx.workflow_id}:v{version}"


@post_entry.intent
def _(ctx):
    return {"amount": ctx.result("decide")["amount"], "category": ctx.result("decide")["category"]}


@post_entry.lookup
def _(ctx):
    return receivers.find_entry(reference=reference(ctx))


@post_entry.lookup_ref
def _(ctx, ref):
    return receivers.by_ref("ledger", ref, mine={"dedupe_key": reference(ctx)})


@create_task.compensate(who="supervisor")
def _(ctx):
    """Cancel the task with a reason."""
    return receivers.cancel_task(task_ref=ctx.intent["remote_ref"], key=ctx.idempotency_key, reason="compensated")


@notify.compensate(who="operator")
def _(ctx):
    """Send a correction to the approver."""
    return receivers.send_correction(client_ref=ctx.idempotency_key, corrects=ctx.intent["remote_ref"], text="ignore")


@post_entry.compensate(who="supervisor")
def _(ctx):
    """Post a reversing ledger entry."""
    return receivers.reverse_entry(entry_ref=ctx.intent["remote_ref"], reference=ctx.idempotency_key)


# --- two calls, the second with no way to find out what happened: an operator reconciles it ---

folded = Workflow(
    "test_folded",
    version=1,
    input_schema=Event,
    workflow_id=lambda i: f"folded:{i['tenant']}:{i['order_id']}",
    description="a call, then a call whose unknown outcome only an operator can settle",
)


@folded.step(effect="a new task in the tracker", rerun=Rerun.NO, reconcile=Reconcile.RESEND, retry=FAST)
def open_task(ctx):
    return receivers.create_task(key=ctx.idempotency_key, payload=ctx.intent)


@open_task.intent
def _(ctx):
    return {"title": f"Approve {ctx.input['order_id']}"}


@folded.step(effect="a message to the approver", rerun=Rerun.NO, reconcile=Reconcile.OPERATOR, retry=FAST)
def tell(ctx):
    return receivers.send_message(client_ref=ctx.idempotency_key, payload=ctx.intent)


@tell.intent
def _(ctx):
    return {"task": ctx.result("open_task")["task_id"]}


@folded.guard("not_on_hold", steps=["tell"])
def _(ctx):
    """No message for an order on hold (a business rule, read from the event: no I/O)."""
    if ctx.input["text"].startswith("on hold"):
        raise PolicyRefusal("not_on_hold", f"order {ctx.input['order_id']} is on hold", {"text": ctx.input["text"]})


# --- local steps: effects written to the engine's own database, committed with the outcome ---

local = Workflow(
    "test_local",
    version=1,
    input_schema=Event,
    workflow_id=lambda i: f"local:{i['tenant']}:{i['order_id']}",
    description="steps whose effect is a row in this database",
)


def _local_row(ctx):
    # No dedupe on purpose: a second commit of the same step would show as a second row.
    obj = RemoteObject.objects.create(kind="local", client_ref=ctx.idempotency_key, payload={"step": ctx.step})
    return Outcome(remote_ref=f"local-{obj.pk}", result={"row": obj.pk})


@local.step(effect="a row in this database", local=True, retry=FAST)
def reserve(ctx):
    return _local_row(ctx)


@local.step(effect="a row in this database", local=True, retry=FAST)
def book(ctx):
    return _local_row(ctx)


# --- secrets: steps that echo credentials back, in results and in errors ---------------
# (tests/engine/test_redaction.py plants the values; nothing here may reach a checkpoint unredacted)

log = logging.getLogger("workflows.test_secrets")


class SecretEvent(BaseModel):
    model_config = ConfigDict(extra="allow")  # a pasted "password" or "api_key" field is kept (redacted)

    tenant: str
    order_id: str
    text: str = ""


def _planted() -> dict[str, str]:
    return {"api_key": settings.OPENAI_API_KEY, "sandbox": settings.SANDBOX_API_KEY, **receivers.PLANTED}


secrets = Workflow(
    "test_secrets",
    version=1,
    input_schema=SecretEvent,
    workflow_id=lambda i: f"secrets:{i['tenant']}:{i['order_id']}",
    description="steps that echo credentials",
    redact_fields=("iban",),
)


@secrets.step(effect="none", rerun=Rerun.YES, retry=FAST)
def fetch(ctx):
    p = _planted()
    receivers.scripted("fetch", ctx.intent)
    if ctx.input.get("explode"):  # an unclassified exception quoting a credential
        raise RuntimeError(f"client crashed with api_key={p['api_key']}")
    log.warning("fetched with key %s via %s", p["api_key"], p["sandbox"])
    return {"echo": f"key={p['api_key']}", "session": {"access_token": p["sandbox"]}, "text": ctx.input["text"]}


@fetch.intent
def _(ctx):
    p = _planted()
    return {
        "url": f"https://api.example/v1?key={p['api_key']}",
        "api_key": p["api_key"],
        "iban": "DE89370400440532013000",
    }


@secrets.decision(schema=Decision, retry=FAST)
def choose(ctx):
    receivers.scripted("choose", ctx.intent)
    return receivers.model_propose("office 5")


@secrets.step(effect="an object elsewhere", rerun=Rerun.NO, reconcile=Reconcile.LOOKUP, retry=FAST, compensable=True)
def create(ctx):
    receivers.scripted("create", ctx.intent)
    return Outcome(remote_ref="obj-1", result={"id": "obj-1"})


@create.intent
def _(ctx):
    return {"title": "object", "approver": ctx.result("choose")["approver"], "echo": ctx.result("fetch")["echo"]}


@create.lookup
def _(ctx):
    p = _planted()
    return Outcome(
        remote_ref="obj-1",
        result={"id": "obj-1", "token": p["sandbox"], "note": f"Authorization: Bearer {p['sandbox']}"},
    )


@create.compensate(who="supervisor")
def _(ctx):
    """Delete the object."""
    p = _planted()
    receivers.scripted("create.compensate", ctx.intent)
    return Outcome(
        remote_ref="deleted-obj-1",
        result={"password": p["password"], "echo": f"deleted with {p['api_key']}"},
        incident=f"deleted by token {p['ingestion']}",
    )


@secrets.step(effect="a message", rerun=Rerun.NO, reconcile=Reconcile.LOOKUP, retry=FAST, outbox=True)
def tell(ctx):
    receivers.scripted("tell", ctx.intent)
    return Outcome(remote_ref="msg-1", result={"echo": f"sent with {_planted()['api_key']}"})


@tell.intent
def _(ctx):
    return {"to": ctx.result("choose")["approver"], "api_key": _planted()["api_key"], "text": ctx.input["text"]}


@tell.lookup
def _(ctx):
    return None  # a failed attempt never sent it


@secrets.step(effect="a ledger entry", rerun=Rerun.NO, reconcile=Reconcile.LOOKUP, retry=FAST)
def settle(ctx):
    receivers.scripted("settle", ctx.intent)
    return Outcome(remote_ref="entry-1")


@settle.lookup
def _(ctx):
    return None


# --- four-eyes: test_orders' steps, with compensate, terminate and "mark succeeded" behind a
# second supervisor's approval ----------------------------------------------------------------

guarded = Workflow(
    "test_guarded",
    version=1,
    input_schema=Event,
    workflow_id=lambda i: f"guarded:{i['tenant']}:{i['order_id']}",
    description="engine test workflow with four-eyes actions",
    four_eyes=True,
)
guarded.steps = list(orders.steps)


# --- guards: test_orders' steps, with the decision checked before anything is written -------

policy = Workflow(
    "test_policy",
    version=1,
    input_schema=Event,
    workflow_id=lambda i: f"policy:{i['tenant']}:{i['order_id']}",
    description="engine test workflow with guards",
)
policy.steps = list(orders.steps)
BOSS_ABOVE = 1000  # amounts above this are approved by "boss", the others by "alice"


@policy.guard("approver_policy")
def _(ctx):
    """The approver is the one the policy assigns for the amount."""
    expected = "boss" if ctx.decision["amount"] > BOSS_ABOVE else "alice"
    if ctx.decision["approver"] != expected:
        raise PolicyRefusal(
            "approver_policy",
            f"{ctx.decision['approver']} may not approve {ctx.decision['amount']}",
            {"proposed": ctx.decision["approver"], "policy": expected, "amount": ctx.decision["amount"]},
        )


@policy.guard("not_yet_booked", steps=["create_task"])
def _(ctx):
    """The order is not booked in the ledger already (a fresh read, which can fail)."""
    found = receivers.look_up_entry(reference=ctx.workflow_id)
    if found is not None:
        raise PolicyRefusal("not_yet_booked", f"already booked as {found.remote_ref}", {"entry": found.remote_ref})


# --- an agent step: the model calls tools in a loop; every turn and call is journaled --------


class Dispute(BaseModel):
    tenant: str
    order_id: str
    invoice: str = "inv-1"
    amount: int = 120


class Resolution(BaseModel):
    resolution: str = Field(pattern="^(credited|refused)$")
    amount: int = Field(ge=0)


class InvoiceArgs(BaseModel):
    invoice: str


class CreditArgs(BaseModel):
    invoice: str
    amount: int = Field(ge=0)


class NotifyArgs(BaseModel):
    text: str


CREDIT_LIMIT = 500  # a guard refuses credits above this

disputes = Workflow(
    "test_agent",
    version=1,
    input_schema=Dispute,
    workflow_id=lambda i: f"dispute:{i['tenant']}:{i['order_id']}",
    description="engine test workflow with an agent step",
)


@disputes.tool(arguments=InvoiceArgs, effect="none", rerun=Rerun.YES, retry=FAST)
def find_invoice(ctx):
    """Look an invoice up."""
    return {"invoice": ctx.intent["invoice"], "amount": ctx.input["amount"]}


@disputes.tool(
    arguments=CreditArgs,
    effect="a ledger entry",
    rerun=Rerun.NO,
    reconcile=Reconcile.LOOKUP,
    retry=FAST,
    compensable=True,
)
def credit(ctx):
    """Post a credit note to the ledger."""
    return receivers.post_entry(reference=ctx.idempotency_key, payload=ctx.intent)


@credit.lookup
def _(ctx):
    return receivers.find_entry(reference=ctx.idempotency_key)


@credit.lookup_ref
def _(ctx, ref):
    return receivers.by_ref("ledger", ref, mine={"dedupe_key": ctx.idempotency_key})


@credit.compensate(who="supervisor")
def _(ctx):
    """Reverse the credit note."""
    return receivers.reverse_entry(entry_ref=ctx.intent["remote_ref"], reference=ctx.idempotency_key)


@credit.guard("credit_limit")
def _(ctx):
    """A credit note is at most the credit limit."""
    if ctx.intent["amount"] > CREDIT_LIMIT:
        raise PolicyRefusal("credit_limit", f"{ctx.intent['amount']} is over {CREDIT_LIMIT}", dict(ctx.intent))


@disputes.tool(arguments=NotifyArgs, effect="a message", rerun=Rerun.NO, reconcile=Reconcile.LOOKUP, retry=FAST)
def notify_customer(ctx):
    """Message the customer."""
    return receivers.send_message(client_ref=ctx.idempotency_key, payload=ctx.intent)


@notify_customer.lookup
def _(ctx):
    return receivers.find_message(client_ref=ctx.idempotency_key)


@notify_customer.lookup_ref
def _(ctx, ref):
    return receivers.by_ref("message", ref, mine={"client_ref": ctx.idempotency_key})


@disputes.agent(tools=[find_invoice, credit, notify_customer], schema=Resolution, max_turns=5, retry=FAST)
def resolve(ctx):
    """Resolve the customer's dispute with the tools."""
    return receivers.agent_reply(ctx.input, ctx.messages, [t["function"]["name"] for t in ctx.tools])


# The journal of a dispute the scripted model resolves: find the invoice, then credit it and tell
# the customer in one turn, then answer.
JOURNAL = [
    "resolve:1",
    "resolve:1:0:find_invoice",
    "resolve:2",
    "resolve:2:0:credit",
    "resolve:2:1:notify_customer",
    "resolve:3",
]


@disputes.step(effect="none", rerun=Rerun.YES, retry=FAST)
def close(ctx):
    return {"closed": ctx.result("resolve")["resolution"]}


refusing_disputes = Workflow(
    "test_agent_review",
    version=1,
    input_schema=Dispute,
    workflow_id=lambda i: f"dispute-review:{i['tenant']}:{i['order_id']}",
    description="test_agent, with a tool's refusal held for an operator",
)
refusing_disputes.tools = dict(disputes.tools)


@refusing_disputes.agent(
    tools=[find_invoice, credit, notify_customer], schema=Resolution, refusals="review", retry=FAST, name="resolve"
)
def _(ctx):
    return resolve.call(ctx)
