"""Per-step retry policies (the vocabulary of Temporal's RetryPolicy)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import timedelta

from recovery.errors import RETRYABLE_KINDS, ErrorKind, StepError


@dataclass(frozen=True)
class RetryPolicy:
    """How one step retries. Every budget is finite: there is no unbounded retry loop."""

    initial_interval: float = 1.0
    """Seconds before the first retry."""
    backoff_coefficient: float = 2.0
    """Each retry waits this many times the previous wait (before jitter)."""
    maximum_interval: float = 60.0
    """No computed wait exceeds this (a Retry-After from the receiver may)."""
    maximum_attempts: int = 5
    """Attempts in all, the first included; then the step goes to review."""
    maximum_elapsed: float = 3600.0
    """Seconds from the first attempt after which no retry is scheduled."""
    non_retryable_kinds: frozenset[ErrorKind] = field(default_factory=frozenset)
    """Kinds that stop at once even if they would normally retry."""
    jitter: float = 0.1
    """Fraction of the wait randomised either way (0 disables jitter)."""
    maximum_format_failures: int = 3
    """For model steps: schema-invalid outputs tolerated before pausing for review."""

    def __post_init__(self) -> None:
        if self.initial_interval < 0:
            raise ValueError("initial_interval must be >= 0")
        if self.backoff_coefficient < 1:
            raise ValueError("backoff_coefficient must be >= 1")
        if self.maximum_interval < self.initial_interval:
            raise ValueError("maximum_interval must be >= initial_interval")
        if self.maximum_attempts < 1:
            raise ValueError("maximum_attempts must be >= 1 (unbounded retries are not allowed)")
        if self.maximum_elapsed <= 0:
            raise ValueError("maximum_elapsed must be > 0")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must be in [0, 1)")
        if self.maximum_format_failures < 1:
            raise ValueError("maximum_format_failures must be >= 1")
        object.__setattr__(self, "non_retryable_kinds", frozenset(ErrorKind(k) for k in self.non_retryable_kinds))

    def backoff(self, attempt: int, rand: float | None = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based), with jitter."""
        base = min(self.maximum_interval, self.initial_interval * self.backoff_coefficient ** (attempt - 1))
        r = random.random() if rand is None else rand
        return max(0.0, base * (1 + self.jitter * (2 * r - 1)))

    def next_delay(
        self, attempt: int, error: StepError, *, elapsed: float = 0.0, rand: float | None = None
    ) -> float | None:
        """Seconds until the next attempt, or None when the step must not be retried.

        ``attempt`` counts attempts made in this budget (the failed one included);
        ``elapsed`` is the time since the budget's first attempt. Retry-After is honoured
        as a lower bound.
        """
        if not self.retries(error.kind):
            return None
        if attempt >= self.maximum_attempts:
            return None
        delay = self.backoff(attempt, rand)
        if error.retry_after is not None:
            delay = max(delay, float(error.retry_after))
        if elapsed + delay > self.maximum_elapsed:
            return None
        return delay

    def retries(self, kind: ErrorKind) -> bool:
        return kind in RETRYABLE_KINDS and kind not in self.non_retryable_kinds

    def as_text(self) -> str:
        return (
            f"{self.maximum_attempts} attempts, {self.initial_interval:g}s ×{self.backoff_coefficient:g} "
            f"≤ {self.maximum_interval:g}s, within {timedelta(seconds=self.maximum_elapsed)}"
        )


DEFAULT_POLICY = RetryPolicy()
