"""A run's life outside its steps: starting it from an event, waiting, releasing, completing,
parking it for review."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction

from recovery import clock, tracing
from recovery.engine import dispatch
from recovery.errors import StartConflict
from recovery.models import RunState, StepExecution, WorkflowRun
from recovery.workflow import Workflow, get_workflow, idempotency_key, payload_hash

from ._core import (
    RUN_LEASE_FIELDS,
    Lease,
    _abandon_running_steps,
    _audit,
    _check,
    _locked_run,
    _release_into,
    _save_run,
    _snap,
)
from .tables import RUN_TRANSITIONS

# --- starting a run --------------------------------------------------------------------


def run_start(
    *,
    workflow: Workflow | str,
    data: Any,
    actor: AbstractBaseUser | str | None = None,
    now: datetime | None = None,
    reserve: tuple[str, datetime] | None = None,
) -> tuple[WorkflowRun, bool]:
    """Create the run for a business event, or return the one that event already created.

    The workflow id comes from the event, never from a worker or an attempt. The unique
    constraint on ``workflow_id`` decides between concurrent starts, not a pre-check. The
    same id with a different input is a conflict, never a silent replay. With ``reserve``
    (owner, until), only that executor claims the new run until then, or until it releases it
    (``runs_release_reservation``); an existing run is returned as it is.
    """
    wf = get_workflow(workflow) if isinstance(workflow, str) else workflow
    # What is persisted is what is replayed: the run's input is kept redacted, and its id and
    # hash are taken from that, so a secret is neither stored nor hashed.
    validated = wf.redact(wf.validate_input(data))
    workflow_id = wf.workflow_id(validated)
    limit = WorkflowRun._meta.get_field("workflow_id").max_length
    if not isinstance(workflow_id, str) or not 0 < len(workflow_id) <= limit:
        length = len(workflow_id) if isinstance(workflow_id, str) else 0
        raise ValueError(
            f"the workflow id must be 1 to {limit} characters (the event's keys make it); this one has "
            f"{length:,} (at most {limit})"
        )
    input_hash = payload_hash(validated)
    now = now or clock.now()
    try:
        with transaction.atomic():
            run = WorkflowRun.objects.create(
                workflow_id=workflow_id,
                workflow_name=wf.name,
                workflow_version=wf.version,
                state=RunState.PENDING,
                input=validated,
                input_hash=input_hash,
                created_at=now,
                updated_at=now,
                traceparent=tracing.traceparent() or None,
                reserved_for=reserve[0] if reserve else None,
                reserved_until=reserve[1] if reserve else None,
            )
            StepExecution.objects.bulk_create(
                StepExecution(
                    run=run,
                    step_name=spec.name,
                    position=spec.position,
                    key_version=spec.key_version,
                    idempotency_key=idempotency_key(workflow_id, spec.name, spec.key_version),
                    updated_at=now,
                )
                for spec in wf.steps
            )
            _audit(run, "start", actor=actor, before={}, after=_snap(run), now=now)
            if reserve is None:  # a reserved run is driven by the executor it is reserved for
                dispatch.enqueue_run(run.pk)
    except IntegrityError:
        run = WorkflowRun.objects.get(workflow_id=workflow_id)
        if run.input_hash != input_hash:
            raise StartConflict(
                f"run {workflow_id} already exists with a different input; start a new business event instead"
            ) from None
        return run, False
    return run, True


def run_wait(*, lease: Lease, wake_at: datetime, reason: str, now: datetime | None = None) -> None:
    """Nothing is due before ``wake_at``: give the run back with its wake-up time."""
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run(lease)
        before = _snap(run)
        if run.state == RunState.COMPENSATING:  # a compensation waits as compensating
            target = _check(RUN_TRANSITIONS, "compensation_wait", run.state, "run")
        else:
            target = _check(RUN_TRANSITIONS, "wait", run.state, "run")
        _release_into(run, target, wake_at=wake_at, reason=reason)
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now)
        _audit(run, "wait", actor=None, reason=reason, before=before, after=_snap(run), now=now)


def run_release(*, lease: Lease, reason: str, now: datetime | None = None) -> None:
    """Give the run back, due at once (the executor stopped early by choice)."""
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run(lease)
        before = _snap(run)
        _check(RUN_TRANSITIONS, "release", run.state, "run")
        _release_into(run, RunState.PENDING, reason=reason)
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now)
        _audit(run, "release", actor=None, reason=reason, before=before, after=_snap(run), now=now)


def run_complete(*, lease: Lease, now: datetime | None = None) -> None:
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run(lease)
        before = _snap(run)
        _check(RUN_TRANSITIONS, "complete", run.state, "run")
        _release_into(run, RunState.COMPLETED)
        run.current_step = ""
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason", "current_step"], now)
        _audit(run, "complete", actor=None, before=before, after=_snap(run), now=now)


def run_review(*, lease: Lease, reason: str, step_name: str = "", now: datetime | None = None) -> None:
    """Stop and hand the run to an operator (a conflict the executor must not resolve). A
    parked run never keeps a step ``running``: a call that may have been made is unknown."""
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run(lease)
        before = _snap(run)
        _check(RUN_TRANSITIONS, "review", run.state, "run")
        abandoned = _abandon_running_steps(run, now, None)
        lease.seen.clear()  # its copy of those steps is out of date
        _release_into(run, RunState.NEEDS_REVIEW, reason=reason)
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now)
        after = {**_snap(run), "steps_now_unknown": abandoned} if abandoned else _snap(run)
        _audit(run, "review", actor=None, step_name=step_name, reason=reason, before=before, after=after, now=now)
