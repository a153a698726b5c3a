"""The heartbeat: an executor renews its lease while one of its calls is in flight (rule 12).

A call may take longer than the lease (a slow receiver, a long model answer). Without renewal,
another executor would take the run over while the first one's request is still in flight and
act on a state that is about to change. So every call the executor makes (a step, a look-up, a
compensation, an outbox delivery) is wrapped in ``held_run`` / ``held_claim``, and a daemon
thread renews what is held once it has been in flight for ``RECOVERY_HEARTBEAT_SECONDS``.

Each renewal is fenced like every executor write: it matches only while the lease generation
(or the outbox claim generation) is still the one the call was started under, so a heartbeat
never revives a lease that was taken over or terminated. A renewal that matches nothing, or
that cannot reach the database, is logged; the call goes on (it cannot be recalled) and the
executor's next fenced write finds out. That is why the in-flight window exists too: a run
taken over while a call is in flight treats that call as able to commit until its deadline.

Renewal writes neither ``updated_at`` nor the run's revision: the executor's copy of the run
stays current and an operator's open page does not go stale because a call is slow.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import DatabaseError, connection

from recovery import clock
from recovery.models import OutboxMessage, OutboxState, RunState, WorkflowRun

log = logging.getLogger("recovery.heartbeat")

_LEASED = [RunState.RUNNING, RunState.COMPENSATING]


@dataclass
class _Held:
    what: str  # "run" or "outbox"
    pk: int
    generation: int
    renewed: float  # time.monotonic() of the start or the last renewal
    lost: bool = False


_lock = threading.Lock()
_held: dict[int, _Held] = {}
_tokens = itertools.count(1)
_thread: threading.Thread | None = None
_wake = threading.Event()


@contextmanager
def held_run(run_pk: int, generation: int) -> Iterator[None]:
    """Keep the run's lease (generation ``generation``) alive while the body runs."""
    with _holding(_Held("run", run_pk, generation, time.monotonic())):
        yield


@contextmanager
def held_claim(outbox_pk: int, generation: int) -> Iterator[None]:
    """Keep an outbox claim alive while its delivery attempt is in flight."""
    with _holding(_Held("outbox", outbox_pk, generation, time.monotonic())):
        yield


@contextmanager
def _holding(entry: _Held) -> Iterator[None]:
    token = next(_tokens)
    with _lock:
        _held[token] = entry
    _ensure_thread()
    try:
        yield
    finally:
        with _lock:
            _held.pop(token, None)


def beat(*, force: bool = False) -> int:
    """Renew every held lease and claim that has been in flight for a heartbeat interval (with
    ``force``, all of them: a test driving the clock beats as the thread would have).
    Returns how many were renewed."""
    interval = settings.RECOVERY_HEARTBEAT_SECONDS
    now_mono = time.monotonic()
    with _lock:
        due = [e for e in _held.values() if not e.lost and (force or now_mono - e.renewed >= interval)]
    renewed = 0
    for entry in due:
        until = clock.now() + timedelta(seconds=settings.RECOVERY_LEASE_SECONDS)
        try:
            if entry.what == "run":
                matched = WorkflowRun.objects.filter(
                    pk=entry.pk, lease_generation=entry.generation, state__in=_LEASED
                ).update(lease_expires_at=until)
            else:
                matched = OutboxMessage.objects.filter(
                    pk=entry.pk, claim_generation=entry.generation, state=OutboxState.PENDING
                ).update(claimed_until=until)
        except DatabaseError as exc:
            log.warning("heartbeat could not renew %s %s: %s", entry.what, entry.pk, exc)
            if threading.current_thread() is _thread:
                connection.close()  # the thread's own: a dead connection is replaced at the next beat
            continue
        entry.renewed = now_mono
        if matched:
            renewed += 1
        else:
            entry.lost = True
            log.warning(
                "heartbeat: %s %s is no longer held under generation %s; its call is still in flight",
                entry.what,
                entry.pk,
                entry.generation,
            )
    return renewed


def _ensure_thread() -> None:
    global _thread
    if _thread is not None and _thread.is_alive():
        return
    with _lock:
        if _thread is not None and _thread.is_alive():
            return
        _thread = threading.Thread(target=_run, name="recovery-heartbeat", daemon=True)
        _thread.start()


def _run() -> None:
    while True:
        _wake.wait(timeout=max(settings.RECOVERY_HEARTBEAT_SECONDS / 4, 0.05))
        try:
            beat()
        except Exception:  # noqa: BLE001 - the heartbeat must outlive any one failure
            log.exception("heartbeat failed")
        with _lock:
            idle = not _held
        if idle:
            # Nothing in flight: give the connection back (a test database can then be dropped,
            # and a restarted server is met with a fresh connection).
            connection.close()
