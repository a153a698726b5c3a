"""The executor benchmark's workflow (``bench/executor.py``): three steps, each inserting one row keyed
by its idempotency key into ``bench_effect``; a repeated step finds its row and adds none.

Registered only in the benchmark's processes, through
``RECOVERY_WORKFLOW_MODULES=workflows.registry,bench.executor_workflow`` (``bench`` is a namespace
package, importable because the project root is on ``sys.path``). The bench creates the table.
"""

from __future__ import annotations

import contextlib
import os

from django.db import connection
from pydantic import BaseModel

from recovery.workflow import Outcome, Reconcile, Rerun, StepContext, Workflow

EFFECT = "one row in bench_effect"
INSERT_EFFECT = "INSERT INTO bench_effect (key, run, step) VALUES (%s, %s, %s) ON CONFLICT (key) DO NOTHING"


class BenchInput(BaseModel):
    id: str


bench = Workflow("bench", version=1, input_schema=BenchInput, workflow_id=lambda i: f"bench:{i['id']}")


# BENCH_STEPS=local (the default): the insert is a local step's effect, committed with the
# step's attempt and outcome; the three local steps share one transaction (one commit per run).
# BENCH_STEPS=call: an ordinary step, called outside any transaction, so the insert commits on its
# own (three commits per step: intent, effect, outcome).
LOCAL = os.environ.get("BENCH_STEPS", "local") == "local"

# BENCH_HEARTBEAT=off (the ``ours_call_nohb`` contender only; bench/executor.py sets "on" for the
# others): the heartbeat is a no-op in this process, so that the bench can measure what it costs.
# This module is imported by django.setup() (the recovery app's ready()), before the executor
# runs; the executor calls ``heartbeat.held_run`` / ``heartbeat.held_claim`` through the module,
# so replacing the module's two names is enough, and nothing is started for the heartbeat.
HEARTBEAT = os.environ.get("BENCH_HEARTBEAT", "on")
if HEARTBEAT not in ("on", "off"):
    raise ValueError(f"BENCH_HEARTBEAT must be 'on' or 'off', not {HEARTBEAT!r}")
if HEARTBEAT == "off":
    from recovery.engine import heartbeat

    def _not_held(pk: int, generation: int) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    heartbeat.held_run = heartbeat.held_claim = _not_held


def insert_effect(ctx: StepContext) -> Outcome:
    """The step's side effect, on Django's connection."""
    with connection.cursor() as cursor:
        cursor.execute(INSERT_EFFECT, [ctx.idempotency_key, ctx.workflow_id, ctx.step])
    return Outcome(remote_ref=ctx.idempotency_key)


@bench.step(effect=EFFECT, rerun=Rerun.YES, reconcile=Reconcile.RERUN, local=LOCAL)
def first(ctx: StepContext) -> Outcome:
    return insert_effect(ctx)


@bench.step(effect=EFFECT, rerun=Rerun.YES, reconcile=Reconcile.RERUN, local=LOCAL)
def second(ctx: StepContext) -> Outcome:
    return insert_effect(ctx)


@bench.step(effect=EFFECT, rerun=Rerun.YES, reconcile=Reconcile.RERUN, local=LOCAL)
def third(ctx: StepContext) -> Outcome:
    return insert_effect(ctx)
