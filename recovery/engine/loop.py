"""The embedded executor (``manage.py run_executor``): advance due runs and publish due outbox
messages in this process until stopped, recording a sweeper beat as it goes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from django.db import InterfaceError, OperationalError, connection

from recovery.engine import transitions
from recovery.engine.executor import advance_claimed
from recovery.engine.publisher import publish_due
from recovery.errors import DatabaseUnavailable

log = logging.getLogger("recovery.executor")


def run_due(*, owner: str | None = None, limit: int = 100) -> int:
    """Advance runs due now, the oldest first, up to ``limit``; executors running this side
    by side take different runs. Returns how many runs this executor advanced."""
    advanced = 0
    while advanced < limit:
        lease = transitions.run_claim_next(owner=owner)
        if lease is None:
            break
        advance_claimed(lease)
        advanced += 1
    return advanced


BEAT_SECONDS = 5.0  # how often the embedded executor's loop records that it is sweeping


def run_forever(
    *,
    until_idle: bool = False,
    poll_seconds: float = 1.0,
    owner: str | None = None,
    on_beat: Callable[[], object] | None = None,
) -> int:
    """The embedded executor: advance due runs and publish due outbox messages until stopped
    (or, with ``until_idle``, until nothing is due now). Returns the number of runs advanced
    and messages attempted. Every BEAT_SECONDS it records that a sweeper is alive and calls
    ``on_beat`` (``run_executor`` sweeps the alerts there)."""
    total = 0
    outage = 0  # consecutive rounds the database could not be reached
    beat_due = 0.0  # time.monotonic() of this loop's next sweeper beat (what /readyz reads)
    while True:
        try:
            if time.monotonic() >= beat_due:
                transitions.sweeper_beat(name="embedded executor", by=owner)
                if on_beat is not None:
                    on_beat()  # run_executor: the alerts' sweep
                beat_due = time.monotonic() + BEAT_SECONDS
            advanced = run_due(owner=owner) + publish_due(owner=owner)
        except (DatabaseUnavailable, OperationalError, InterfaceError) as exc:
            # A blip, not a reason to stop: back off (1, 2, 4 … 30 s) and try again; the runs
            # this executor let go of are claimed again once their leases expire.
            connection.close()
            outage += 1
            if until_idle and outage > 5:
                raise
            delay = min(30.0, 2.0 ** (outage - 1))
            log.warning("%s; trying again in %.0f s", exc, delay)
            time.sleep(delay)
            continue
        outage = 0
        total += advanced
        if advanced:
            continue
        if until_idle:
            return total
        time.sleep(poll_seconds)
