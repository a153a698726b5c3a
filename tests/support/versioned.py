"""A workflow with two versions side by side, against the counting receivers.

v2 (current): read -> check (new in v2: reads, writes nothing) -> create_task -> post_entry.
v1 (kept until its runs drain): the same without ``check``, in tests/support/versioned_v1.py, so
that a process can be started without it (a deploy that dropped v1: the rolling deploy test).
"""

from pydantic import BaseModel

from recovery.workflow import Reconcile, Rerun, Workflow

from . import receivers
from .workflows import FAST


class Event(BaseModel):
    tenant: str
    order_id: str
    amount: int = 120


versioned = Workflow(
    "test_versioned",
    version=2,
    input_schema=Event,
    workflow_id=lambda i: f"versioned:{i['tenant']}:{i['order_id']}",
    description="two versions side by side",
)


@versioned.step(effect="none", rerun=Rerun.YES, retry=FAST)
def read(ctx):
    return {"amount": ctx.input["amount"]}


@versioned.step(effect="none", rerun=Rerun.YES, retry=FAST)
def check(ctx):
    receivers.scripted("check", ctx.input["order_id"])
    return {"duplicate": False}


@versioned.step(effect="a task", rerun=Rerun.NO, reconcile=Reconcile.RESEND, retry=FAST, compensable=True)
def create_task(ctx):
    return receivers.create_task(key=ctx.idempotency_key, payload=ctx.intent)


@create_task.intent
def _(ctx):
    return {"title": f"Approve {ctx.input['order_id']}", "amount": ctx.result("read")["amount"]}


@create_task.compensate(who="supervisor")
def _(ctx):
    """Cancel the task."""
    return receivers.cancel_task(task_ref=ctx.intent["remote_ref"], key=ctx.idempotency_key, reason="compensated")


@versioned.step(effect="a ledger entry", rerun=Rerun.NO, reconcile=Reconcile.LOOKUP, retry=FAST)
def post_entry(ctx):
    return receivers.post_entry(reference=ctx.workflow_id, payload=ctx.intent)


@post_entry.intent
def _(ctx):
    return {"amount": ctx.result("read")["amount"], "task": ctx.result("create_task")["task_id"]}


@post_entry.lookup
def _(ctx):
    return receivers.find_entry(reference=ctx.workflow_id)
