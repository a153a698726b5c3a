"""The embedded executor (``manage.py run_executor``): advance due runs and publish due outbox
messages in this process until stopped, recording a sweeper beat and its own beat in the record
of live executors (``Executor``) as it goes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection

from recovery.engine import transitions
from recovery.engine.executor import advance_claimed
from recovery.engine.publisher import publish_due
from recovery.errors import DatabaseUnavailable
from recovery.models import ExecutorMode

log = logging.getLogger("recovery.executor")


def run_due(*, owner: str | None = None, limit: int = 100, between: Callable[[], object] | None = None) -> int:
    """Advance runs due now, the oldest first, up to ``limit``; executors running this side
    by side take different runs. ``between`` is called before each claim (the loop's beat, so
    that a backlog does not silence it). Returns how many runs this executor advanced."""
    advanced = 0
    while advanced < limit:
        if between is not None:
            between()
        lease = transitions.run_claim_next(owner=owner)
        if lease is None:
            break
        advance_claimed(lease)
        advanced += 1
    return advanced


class _Beat:
    """The loop's beat, at most every RECOVERY_SWEEP_SECONDS (of ``time.monotonic``), at least once
    per round: the sweeper's beat (what /readyz reads), this executor's beat in the record of live
    executors (registered by the first), then ``on_beat``."""

    def __init__(self, owner: str, on_beat: Callable[[], object] | None) -> None:
        self.owner, self.on_beat = owner, on_beat
        self.registered = False
        self.due = 0.0  # time.monotonic() of the next beat

    def __call__(self) -> None:
        if time.monotonic() < self.due:
            return
        transitions.sweeper_beat(name="embedded executor", by=self.owner)
        if self.registered:
            transitions.executor_beat(mode=ExecutorMode.EMBEDDED, owner=self.owner)
        else:
            transitions.executor_register(mode=ExecutorMode.EMBEDDED, owner=self.owner)
            self.registered = True
        if self.on_beat is not None:
            self.on_beat()  # run_executor: the alerts' sweep
        self.due = time.monotonic() + settings.RECOVERY_SWEEP_SECONDS


def run_forever(
    *,
    until_idle: bool = False,
    poll_seconds: float = 1.0,
    owner: str | None = None,
    on_beat: Callable[[], object] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> int:
    """The embedded executor: advance due runs and publish due outbox messages until stopped
    (or, with ``until_idle``, until nothing is due now; or once ``should_stop()`` holds, checked
    between runs and polls: ``run_executor`` on SIGTERM). Returns the number of runs advanced and
    messages attempted. It registers in the record of live executors at its first beat, beats
    every RECOVERY_SWEEP_SECONDS (and calls ``on_beat``, where ``run_executor`` sweeps the
    alerts) and, on a clean exit (returning, Ctrl-C, SystemExit), marks itself stopped."""
    owner = owner or transitions.default_owner()
    beat = _Beat(owner, on_beat)
    stopping = should_stop or (lambda: False)

    def between() -> None:
        beat()  # the first registers this executor
        if stopping():
            raise _Stop

    try:
        total = _rounds(until_idle, poll_seconds, owner, between)
    except (KeyboardInterrupt, SystemExit):
        _stopped(beat)
        raise
    _stopped(beat)
    return total


def _stopped(beat: _Beat) -> None:
    """A clean exit: recorded, so that the console does not take it for a silent executor. (One
    that crashed says nothing: it is silent.)"""
    if not beat.registered:
        return
    try:
        transitions.executor_stop(owner=beat.owner)
    except (DatabaseUnavailable, OperationalError, InterfaceError) as exc:
        log.warning("could not record that this executor stopped: %s", exc)


class _Stop(Exception):
    """``should_stop()`` held: leave the loop between two runs."""


def _rounds(until_idle: bool, poll_seconds: float, owner: str, between: Callable[[], None]) -> int:
    total = 0
    outage = 0  # consecutive rounds the database could not be reached
    while True:
        try:
            between()
            advanced = run_due(owner=owner, between=between) + publish_due(owner=owner)
        except _Stop:
            return total
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
