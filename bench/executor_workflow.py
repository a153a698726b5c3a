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

# BENCH_VERSION_FILTER=off (the ``*_anyversion`` contenders only; bench/executor.py sets "on" for
# the others): this process claims (and publishes for) runs of any workflow version, so that the
# bench can measure what the claim's version filter costs. ``registry.deployed_filter`` is what
# the claim (transitions.leases._pick_sql), the publisher's look-up (publisher.due_outbox_ids) and
# the outbox claim (transitions.outbox.outbox_claim) add to their queries, each calling it
# through the module: replaced by an empty Q, it adds nothing. ``_pick_sql`` caches the claim's
# SQL by its arguments, so its cache is cleared here, before anything has claimed;
# ``claim_filter`` checks, after the work, the statement the claims ran.
VERSION_FILTER = os.environ.get("BENCH_VERSION_FILTER", "on")
if VERSION_FILTER not in ("on", "off"):
    raise ValueError(f"BENCH_VERSION_FILTER must be 'on' or 'off', not {VERSION_FILTER!r}")
if VERSION_FILTER == "off":
    from django.db.models import Q

    from recovery import registry
    from recovery.engine.transitions import leases

    def _any_version(pairs: object = None, prefix: str = "") -> Q:
        return Q()

    registry.deployed_filter = _any_version
    leases._pick_sql.cache_clear()


def claim_filter() -> str:
    """What the claim's statement filtered on in this process, checked against BENCH_VERSION_FILTER,
    after the executor has claimed (the worker's ``done`` line carries it): ``filter=on
    deployed=bench:1,dispute:1,invoice:1+2`` (the (name, version) pairs it tests) or ``filter=off
    deployed=…``. Reads ``leases._pick_sql`` with the very arguments ``_claim_in_one_statement``
    passes and raises unless that was a cache hit (so it is the statement the claims ran) and the
    statement matches the switch."""
    from recovery import registry
    from recovery.engine.transitions import leases

    deployed = registry.deployed()
    misses = leases._pick_sql.cache_info().misses
    sql, params = leases._pick_sql(connection.vendor, False, deployed, leases._PICKED)
    if leases._pick_sql.cache_info().misses != misses:
        raise AssertionError("the claim did not run the statement checked here (not in _pick_sql's cache)")
    filtered = '"workflow_version"' in sql
    if filtered != (VERSION_FILTER == "on"):
        raise AssertionError(f"BENCH_VERSION_FILTER={VERSION_FILTER} but the claim's SQL is: {sql}")
    if filtered and not {name for name, _ in deployed} <= set(params):
        raise AssertionError(f"the claim's parameters lack a deployed workflow: {params}")
    pairs = ",".join(f"{name}:{'+'.join(map(str, versions))}" for name, versions in deployed)
    return f"filter={VERSION_FILTER} deployed={pairs}"


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
