"""The executor benchmark's workflow (``bench/executor.py``): three steps, each inserting one row keyed
by its idempotency key into ``bench_effect``; a repeated step finds its row and adds none.

Registered only in the benchmark's processes, through
``RECOVERY_WORKFLOW_MODULES=workflows.registry,bench.executor_workflow`` (``bench`` is a namespace
package, importable because the project root is on ``sys.path``). The bench creates the table.
"""

from __future__ import annotations

from django.db import connection
from pydantic import BaseModel

from recovery.workflow import Outcome, Reconcile, Rerun, StepContext, Workflow

EFFECT = "one row in bench_effect"
INSERT_EFFECT = "INSERT INTO bench_effect (key, run, step) VALUES (%s, %s, %s) ON CONFLICT (key) DO NOTHING"


class BenchInput(BaseModel):
    id: str


bench = Workflow("bench", version=1, input_schema=BenchInput, workflow_id=lambda i: f"bench:{i['id']}")


def insert_effect(ctx: StepContext) -> Outcome:
    """The step's side effect, on Django's connection: the executor calls a step outside any
    transaction, so the insert commits on its own (autocommit)."""
    with connection.cursor() as cursor:
        cursor.execute(INSERT_EFFECT, [ctx.idempotency_key, ctx.workflow_id, ctx.step])
    return Outcome(remote_ref=ctx.idempotency_key)


@bench.step(effect=EFFECT, rerun=Rerun.YES, reconcile=Reconcile.RERUN)
def first(ctx: StepContext) -> Outcome:
    return insert_effect(ctx)


@bench.step(effect=EFFECT, rerun=Rerun.YES, reconcile=Reconcile.RERUN)
def second(ctx: StepContext) -> Outcome:
    return insert_effect(ctx)


@bench.step(effect=EFFECT, rerun=Rerun.YES, reconcile=Reconcile.RERUN)
def third(ctx: StepContext) -> Outcome:
    return insert_effect(ctx)
