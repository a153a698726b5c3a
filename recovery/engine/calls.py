"""Calling workflow code: with no database lock held, the lease (or the outbox claim) renewed
while the call is in flight, and its exceptions classified once (errors.classify)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

import pydantic
from django.db import connection

from recovery.engine import failpoints, heartbeat, transitions
from recovery.engine.transitions import Lease
from recovery.errors import DatabaseUnavailable, InvalidModelOutput, StepError, classify
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
) -> tuple[Any, StepError | None]:
    """Call workflow code (a step, a look-up, a compensation) with no database lock held,
    renewing the run's ``lease`` (or the outbox ``claim``) while it is in flight (the
    heartbeat). Its exceptions come back classified (errors.classify); an armed failpoint's
    FailpointRaised passes through, as a crash would. With ``point``, the before_call and
    after_call failpoints of that name surround the call."""
    if point:
        failpoints.hit(point, "before_call")
    if lease is not None:
        held = heartbeat.held_run(lease.run_pk, lease.generation)
    elif claim is not None:
        held = heartbeat.held_claim(claim.pk, claim.generation)
    else:
        held = contextlib.nullcontext()
    try:
        with held:
            result, error = fn(ctx), None
    except failpoints.FailpointRaised:
        raise
    except Exception as exc:
        result, error = None, classify(exc)
    if point:
        failpoints.hit(point, "after_call")
    return result, error


def validate_decision(spec: StepSpec, raw: Any) -> dict[str, Any]:
    assert spec.decision_schema is not None
    text = raw if isinstance(raw, str) else json.dumps(raw, default=str)
    try:
        data = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
        return spec.decision_schema.model_validate(data).model_dump(mode="json")
    except (ValueError, pydantic.ValidationError) as exc:
        raise InvalidModelOutput(
            f"model output does not match {spec.decision_schema.__name__}: {exc}"[:2000], raw_output=text
        ) from exc


def as_outcome(raw: Any) -> Outcome:
    if isinstance(raw, Outcome):
        return raw
    if raw is None:
        return Outcome()
    if isinstance(raw, dict):
        return Outcome(remote_ref=str(raw.get("remote_ref", raw.get("id", ""))), result=raw)
    return Outcome(remote_ref="", result={"value": raw})
