"""The engine's error taxonomy.

Adapters classify once, at their boundary, and raise a ``StepError`` with its kind; the
executor never guesses from an exception's type what a retry would do.
"""

from __future__ import annotations

from typing import Any

from django.db import models


class ErrorKind(models.TextChoices):
    TRANSIENT = "transient"  # transport error, 5xx, "service unavailable": retry with backoff
    RATE_LIMITED = "rate_limited"  # 429: retry, honouring Retry-After
    PERMANENT = "permanent"  # bad input, authorisation, policy, unsupported: no retry
    UNKNOWN_OUTCOME = "unknown_outcome"  # may have happened: reconcile, never retry blindly
    INVALID_MODEL_OUTPUT = "invalid_model_output"  # schema-invalid proposal: small budget
    POLICY_REFUSED = "policy_refused"  # a guard refused the step before its intent: review, nothing written
    UNCLASSIFIED = "unclassified"  # nobody said what this is: operator review


RETRYABLE_KINDS = frozenset({ErrorKind.TRANSIENT, ErrorKind.RATE_LIMITED})


class StepError(Exception):
    """A classified failure of one step attempt."""

    kind: ErrorKind = ErrorKind.UNCLASSIFIED

    def __init__(self, message: str, *, retry_after: float | None = None, raw_output: str | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.raw_output = raw_output

    def __str__(self) -> str:
        return self.message


class TransientError(StepError):
    kind = ErrorKind.TRANSIENT


class RateLimited(StepError):
    kind = ErrorKind.RATE_LIMITED


class PermanentError(StepError):
    kind = ErrorKind.PERMANENT


class NotThisStep(PermanentError):
    """A remote object found by an operator's id is not the step's own: another request (another
    key, reference or tenant) made it. Raised by a step's ``@lookup_ref``."""


class UnknownOutcome(StepError):
    kind = ErrorKind.UNKNOWN_OUTCOME


class ExecutorLost(UnknownOutcome):
    """The executor making a call was lost (killed, crashed, redeployed) before it recorded the
    call's outcome: unknown like any, but nothing the receiver said, so not one of its failures."""


class InvalidModelOutput(StepError):
    kind = ErrorKind.INVALID_MODEL_OUTPUT


class UnclassifiedError(StepError):
    kind = ErrorKind.UNCLASSIFIED


def classify(exc: BaseException) -> StepError:
    """Return ``exc`` if it is already classified, else wrap it as unclassified."""
    if isinstance(exc, StepError):
        return exc
    error = UnclassifiedError(f"{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


class PolicyRefusal(Exception):
    """Raised by a guard (``@step.guard``, ``@workflow.guard``): the step must not act on this
    decision. ``rule`` names the policy, ``message`` says what is wrong, ``values`` what the
    guard compared (shown to the operator). Nothing is written: the run waits for review."""

    def __init__(self, rule: str, message: str, values: dict[str, Any] | None = None):
        super().__init__(f"{rule}: {message}")
        self.rule = rule
        self.message = message
        self.values = dict(values or {})


class EngineError(Exception):
    """Base for refusals by the engine itself (not a step's failure)."""


class InvalidTransition(EngineError):
    """The requested transition is not allowed from the current state."""


class NotPermitted(InvalidTransition):
    """The actor's role may not do this (the console answers 403)."""


class RunChanged(InvalidTransition):
    """An operator acted on a stale page: the run changed since it was loaded."""


class PauseConflict(InvalidTransition):
    """Pausing what is paused already, or releasing what is not paused (an API answers 409)."""


class EventRefused(InvalidTransition):
    """An event the run does not wait for, or whose payload its wait refuses (an API answers 400)."""


class EventConflict(InvalidTransition):
    """An event for a finished run, or a key already used for another payload (an API answers 409)."""


class DecisionRefused(InvalidTransition):
    """A person's decision on a tool call that its schema refuses, or that changes nothing (an API
    answers 400)."""


class ApprovalRequired(InvalidTransition):
    """The workflow puts this action behind a second supervisor (four-eyes): request it."""


class LeaseLost(EngineError):
    """Another executor owns the run now: the fenced write matched no row."""


class RunPaused(LeaseLost):
    """The run reached the pause an operator asked for (recovery.engine.transitions.pauses): the
    executor recorded what was in flight, gave the run back as paused and stops."""


class StartConflict(EngineError):
    """A run with this workflow id exists with a different input."""


class DatabaseUnavailable(EngineError):
    """The engine's database could not be reached (a restart, a failover, a dropped
    connection). Infrastructure, not a fault of the workflow: the executor lets go of the run
    and tries again later; the run is never sent to review for it."""
