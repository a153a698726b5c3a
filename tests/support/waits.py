"""Test workflows with durable waits (issue 38): a task, then the approver's event (or the
deadline), a timer, a posting (``test_approvals``); and a task in the simulated tracker, which
calls the run back over HTTP when it is decided (``test_tracked_approval``); an agent whose credit
notes above 100 wait for an operator's approval (``test_held_calls``)."""

from datetime import timedelta

from django.conf import settings
from pydantic import BaseModel, ConfigDict, Field

from recovery.workflow import OnTimeout, PolicyRefusal, Reconcile, Rerun, Workflow

from . import receivers
from .workflows import (
    FAST,
    CreditArgs,
    Dispute,
    Event,
    Resolution,
    credit,
    disputes,
    find_invoice,
    notify_customer,
    resolve,
)

# --- durable waits: a task, then the approver's event (or the deadline), a timer, a posting ----


class Approval(BaseModel):
    model_config = ConfigDict(extra="forbid")
    approved: bool
    amount: int = Field(ge=0)
    by: str


approvals = Workflow(
    "test_approvals",
    version=1,
    input_schema=Event,
    workflow_id=lambda i: f"approval:{i['tenant']}:{i['order_id']}",
    description="a task for the approver, a durable wait for their answer, a cool-down, a posting",
)


@approvals.step(effect="a new task in the tracker", rerun=Rerun.NO, reconcile=Reconcile.RESEND, retry=FAST)
def ask(ctx):
    return receivers.create_task(key=ctx.idempotency_key, payload=ctx.intent)


@ask.intent
def _(ctx):
    return {"title": f"Approve order {ctx.input['order_id']}"}


@approvals.wait(event="approved", timeout=timedelta(days=3), on_timeout=OnTimeout.review(), schema=Approval)
def approval(ctx):
    return None  # the approval as it came


@approvals.sleep(duration=timedelta(hours=1))
def cool_down(ctx):
    return None


@approvals.step(effect="a ledger entry", rerun=Rerun.NO, reconcile=Reconcile.LOOKUP, retry=FAST, compensable=True)
def post_approved(ctx):
    return receivers.post_entry(reference=approved_reference(ctx), payload=ctx.intent)


def approved_reference(ctx) -> str:
    version = ctx.key_version("post_approved")
    return ctx.workflow_id if version == 1 else f"{ctx.workflow_id}:v{version}"


@post_approved.intent
def _(ctx):
    decided = ctx.result("approval")
    return {"amount": decided["amount"] if decided["approved"] else 0, "by": decided["by"]}


@post_approved.lookup
def _(ctx):
    return receivers.find_entry(reference=approved_reference(ctx))


@post_approved.compensate(who="supervisor")
def _(ctx):
    """Reverse the posting."""
    return receivers.reverse_entry(entry_ref=ctx.intent["remote_ref"], reference=ctx.idempotency_key)


# --- a wait answered by the simulated tracker's signed callback (over HTTP) ------------------


class TaskDecision(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: str
    decision: str = Field(pattern="^(approved|rejected)$")
    by: str
    note: str = ""


tracked = Workflow(
    "test_tracked_approval",
    version=1,
    input_schema=Event,
    workflow_id=lambda i: f"tracked:{i['tenant']}:{i['order_id']}",
    description="a task in the simulated tracker, which calls the run back when it is decided",
)


@tracked.step(effect="a task in the tracker", rerun=Rerun.NO, reconcile=Reconcile.RESEND, retry=FAST)
def open_tracked_task(ctx):
    return receivers.sandbox_task(key=ctx.idempotency_key, body=ctx.intent)


@open_tracked_task.intent
def _(ctx):
    events = f"{settings.RECOVERY_CONSOLE_URL}/api/runs/{ctx.workflow_id}/events"
    return {"title": f"Approve order {ctx.input['order_id']}", "assignee": "alice", "callback_url": events}


@tracked.wait(event="task_decided", timeout=timedelta(days=3), on_timeout=OnTimeout.review(), schema=TaskDecision)
def tracker_decision(ctx):
    return None


@tracked.step(effect="a ledger entry", rerun=Rerun.NO, reconcile=Reconcile.LOOKUP, retry=FAST)
def post_decided(ctx):
    return receivers.post_entry(reference=ctx.workflow_id, payload=ctx.intent)


@post_decided.intent
def _(ctx):
    return {"amount": 120, "task": ctx.result("tracker_decision")["task"]}


@post_decided.lookup
def _(ctx):
    return receivers.find_entry(reference=ctx.workflow_id)


@post_decided.guard("approved_by_assignee")
def _(ctx):
    """Nothing is posted unless the task's assignee approved it."""
    decided = ctx.result("tracker_decision")
    if decided["decision"] != "approved":
        said = f"{decided['task']} was {decided['decision']} by {decided['by']}"
        raise PolicyRefusal("approved_by_assignee", said, {"note": decided["note"]})


# --- a tool call held for a person: test_agent, whose credit notes above 100 wait for an operator ---

held_disputes = Workflow(
    "test_held_calls",
    version=1,
    input_schema=Dispute,
    workflow_id=lambda i: f"held:{i['tenant']}:{i['order_id']}",
    description="test_agent, with its credit notes above 100 held for an operator's approval",
)
held_disputes.tools = {name: tool for name, tool in disputes.tools.items() if name != "credit"}
HELD_CALL = "resolve:2:0:credit"


@held_disputes.tool(
    arguments=CreditArgs,
    effect="a ledger entry",
    rerun=Rerun.NO,
    reconcile=Reconcile.LOOKUP,
    retry=FAST,
    compensable=True,
    needs_approval=lambda arguments, ctx: arguments["amount"] > 100,
    approver="operator",
    name="credit",
)
def held_credit(ctx):
    """Post a credit note to the ledger."""
    return credit.call(ctx)


held_credit.lookup(credit.lookup_fn)
held_credit.compensate(credit.compensation_fn, who="supervisor")


@held_disputes.agent(
    tools=[find_invoice, held_credit, notify_customer], schema=Resolution, max_turns=5, retry=FAST, name="resolve"
)
def _(ctx):
    return resolve.call(ctx)
