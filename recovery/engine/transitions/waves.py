"""Releasing many runs at once without flooding a receiver that is just recovering (issue 37):
in waves of ``size`` runs, ``every`` apart, each run of a wave due at a random moment within its
wave's span (jitter), so that they neither come all at once nor in lockstep. Used by a
workflow's unpause (transitions.workflow_pauses) and by bulk resume, retry and unpause."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from recovery.errors import InvalidTransition

MAX_WAVE_SECONDS = 3600  # a wave is at most an hour after the one before


@dataclass(frozen=True)
class Waves:
    """``size`` runs a wave (0: all at once), ``every`` between the starts of two waves."""

    size: int = 0
    every: timedelta = timedelta(0)

    @classmethod
    def parse(cls, size: str | int | None, seconds: str | int | None) -> Waves:
        """From a form or a command line: both or neither. Bad input: InvalidTransition."""
        if size in (None, "", 0, "0") and seconds in (None, "", 0, "0"):
            return cls()
        try:
            n, s = int(size or 0), int(seconds or 0)
        except (TypeError, ValueError):
            raise InvalidTransition("waves: the wave size and the seconds between waves are whole numbers") from None
        if n < 1 or not 1 <= s <= MAX_WAVE_SECONDS:
            raise InvalidTransition(
                f"waves: at least 1 run a wave, and 1 to {MAX_WAVE_SECONDS} seconds between waves (got {n} and {s})"
            )
        return cls(size=n, every=timedelta(seconds=s))

    def due_times(self, count: int, now: datetime, rng: random.Random | None = None) -> list[datetime | None]:
        """When each of ``count`` runs (in release order) becomes due: each run of wave k at
        ``now + k·every + jitter``, the jitter drawn within the wave's span; without waves, all
        None (at once)."""
        if not self.size:
            return [None] * count
        rng = rng or random.Random()
        span = self.every.total_seconds()
        return [now + timedelta(seconds=(i // self.size) * span + rng.uniform(0, span)) for i in range(count)]

    def text(self, count: int) -> str:
        """ "in 3 waves of 10, 60 s apart" """
        if not self.size or count <= self.size and not self.every:
            return "at once"
        waves = -(-count // self.size)
        return f"in {waves} wave{'s' if waves != 1 else ''} of {self.size}, {int(self.every.total_seconds())} s apart"
