"""What every transition reports once it has committed: its counters (recovery.engine.metrics)
and one log record on ``recovery.transitions``, with the run, step, attempt and actor as fields
(recovery.logs). The executor's routine transitions (a claim, an attempt begun or succeeded, a
run completed) are logged at DEBUG; everything an operator may want to read — a failure, an
unknown outcome, a reconcile, a takeover, a refusal, a review, every person's action — at INFO."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import partial
from typing import Any

from django.db import transaction

from recovery import tracing
from recovery.engine import metrics
from recovery.states import ROUTINE_ACTIONS

log = logging.getLogger("recovery.transitions")


def transition(
    *,
    workflow_id: str,
    workflow: str,
    action: str,
    step: str,
    after: Mapping[str, Any],
    lease_generation: int,
    actor: str,
) -> None:
    """A transition wrote its audit event ``action``: count and log it once it commits."""
    metrics.transition(workflow, action, step, after)
    found = metrics.outcome(action, after)
    if found is not None:  # the step attempt's span, when tracing is on
        kind = after.get("error_kind") if found[1] != "succeeded" else None
        tracing.annotate({"workflow.step.outcome": found[1], "error.type": kind})
    level = logging.DEBUG if action in ROUTINE_ACTIONS and actor == "executor" else logging.INFO
    if not log.isEnabledFor(level):
        return
    fields = {
        "workflow_id": workflow_id,
        "workflow": workflow,
        "action": action,
        "lease_generation": lease_generation,
        "actor": actor,
    }
    if step:
        fields["step"] = step
    if "attempts" in after:
        fields["attempt"] = after["attempts"]
    state = after.get("step") or after.get("run") or ""
    message = f"{action} {workflow_id}{f' {step}' if step else ''}{f': {state}' if state else ''}"
    transaction.on_commit(partial(log.log, level, message, extra=fields))
