"""Calling workflow code: with no database lock held, the lease (or the outbox claim) renewed
while the call is in flight, and its exceptions classified once (errors.classify)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pydantic
from django.db import connection

from recovery import logs, tracing
from recovery.engine import failpoints, heartbeat, metrics, transitions
from recovery.engine.transitions import Lease
from recovery.errors import DatabaseUnavailable, InvalidModelOutput, StepError, classify
from recovery.models import WorkflowRun
from recovery.validation import problem_text, problems_of
from recovery.workflow import Outcome, StepContext, StepSpec

log = logging.getLogger("recovery.executor")


def database_unavailable(exc: Exception, what: str) -> DatabaseUnavailable:
    log.warning("database unavailable while advancing %s: %s: %s", what, type(exc).__name__, exc)
    try:
        connection.close()  # the next use opens a fresh connection
    except Exception:  # noqa: BLE001 - closing a dead connection may fail too
        pass
    return DatabaseUnavailable(f"database unavailable while advancing {what}: {type(exc).__name__}: {exc}")


def invoke(
    fn: Callable[[StepContext], Any],
    ctx: StepContext,
    *,
    lease: Lease | None = None,
    claim: transitions.OutboxClaim | None = None,
    point: str = "",
    timed: str = "",
) -> tuple[Any, StepError | None]:
    """Call workflow code (a step, a look-up, a compensation) with no database lock held,
    renewing the run's ``lease`` (or the outbox ``claim``) while it is in flight (the
    heartbeat). Its exceptions come back classified (errors.classify); an armed failpoint's
    FailpointRaised passes through, as a crash would. With ``point``, the before_call and
    after_call failpoints of that name surround the call. With ``timed`` (the run's workflow),
    the call's duration is observed as its step's (``recovery_step_duration_seconds``)."""
    if point:
        failpoints.hit(point, "before_call")
    if lease is not None:
        held = heartbeat.held_run(lease.run_pk, lease.generation)
    elif claim is not None:
        held = heartbeat.held_claim(claim.pk, claim.generation)
    else:
        held = contextlib.nullcontext()
    started = time.perf_counter()
    try:
        with held:
            result, error = fn(ctx), None
    except failpoints.FailpointRaised:
        raise
    except Exception as exc:
        result, error = None, classify(exc)
    if timed:
        metrics.call_took(timed, ctx.step, time.perf_counter() - started)
    if point:
        failpoints.hit(point, "after_call")
    return result, error


@contextmanager
def working_on(
    span: str,
    run: WorkflowRun,
    *,
    parent: str = "",
    lease_generation: int | None = None,
    step: str = "",
    attempt: int | None = None,
    key: str = "",
) -> Iterator[None]:
    """While the executor (or the publisher) works on ``run`` — and on its ``step``'s attempt —
    every log record carries what it works on (recovery.logs), and the work is one span named
    ``span`` (recovery.tracing), child of ``parent`` (a traceparent) when given."""
    attributes: dict[str, Any] = {"workflow.id": run.workflow_id, "workflow.name": run.workflow_name}
    if step:
        attributes.update({"workflow.step.name": step, "workflow.step.attempt": attempt})
    fields = logs.bound(
        workflow_id=run.workflow_id,
        workflow=run.workflow_name,
        lease_generation=lease_generation,
        step=step or None,
        attempt=attempt,
        key=logs.key_prefix(key) if key else None,
        actor=transitions.EXECUTOR,
    )
    with fields, tracing.span(span, parent=parent, attributes=attributes):
        yield


def validate_decision(spec: StepSpec, raw: Any) -> dict[str, Any]:
    assert spec.decision_schema is not None
    text = raw if isinstance(raw, str) else json.dumps(raw, default=str)
    try:
        data = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
        return spec.decision_schema.model_validate(data).model_dump(mode="json")
    except (ValueError, pydantic.ValidationError) as exc:
        # Every problem, one a line (bounded): the console and show_run show the whole list.
        message = problem_text(f"model output does not match {spec.decision_schema.__name__}", problems_of(exc))
        raise InvalidModelOutput(message, raw_output=text) from exc


def as_outcome(raw: Any) -> Outcome:
    if isinstance(raw, Outcome):
        return raw
    if raw is None:
        return Outcome()
    if isinstance(raw, dict):
        return Outcome(remote_ref=str(raw.get("remote_ref", raw.get("id", ""))), result=raw)
    return Outcome(remote_ref="", result={"value": raw})
