"""The waits benchmark's workflows (``bench/waits.py``), local steps only (nothing on a network).

``bench_waits``: a local step, a durable wait for the event ``go`` (three days, then review), a
local step. ``bench_plain``: the same two local steps with no wait between them, the "plain due
runs" the executor drains while the waiting runs are present.

Registered only in the benchmark's process, through
``RECOVERY_WORKFLOW_MODULES=workflows.registry,bench.waits_workflow`` (``bench`` is a namespace
package, importable because the project root is on ``sys.path``).
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel

from recovery.workflow import OnTimeout, Outcome, Reconcile, Rerun, StepContext, Workflow

WAIT_DAYS = 3


class BenchInput(BaseModel):
    id: str


class Go(BaseModel):
    pass


waits = Workflow("bench_waits", version=1, input_schema=BenchInput, workflow_id=lambda i: f"bench_waits:{i['id']}")
plain = Workflow("bench_plain", version=1, input_schema=BenchInput, workflow_id=lambda i: f"bench_plain:{i['id']}")


def _local(ctx: StepContext) -> Outcome:
    return Outcome(result={"step": ctx.step})


@waits.step(effect="none (a local step)", rerun=Rerun.YES, reconcile=Reconcile.RERUN, local=True)
def prepare(ctx: StepContext) -> Outcome:
    return _local(ctx)


@waits.wait(event="go", timeout=timedelta(days=WAIT_DAYS), on_timeout=OnTimeout.review(), schema=Go)
def go(ctx: StepContext) -> None:
    return None  # the event's payload is the step's result


@waits.step(effect="none (a local step)", rerun=Rerun.YES, reconcile=Reconcile.RERUN, local=True)
def finish(ctx: StepContext) -> Outcome:
    return _local(ctx)


@plain.step(effect="none (a local step)", rerun=Rerun.YES, reconcile=Reconcile.RERUN, local=True)
def plain_prepare(ctx: StepContext) -> Outcome:
    return _local(ctx)


@plain.step(effect="none (a local step)", rerun=Rerun.YES, reconcile=Reconcile.RERUN, local=True)
def plain_finish(ctx: StepContext) -> Outcome:
    return _local(ctx)
