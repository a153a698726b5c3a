"""The record of live executors (``Executor``): the only code that writes it.

An executor registers when it starts, beats at least once per sweep interval
(``RECOVERY_SWEEP_SECONDS``) and marks itself stopped on a clean exit. Bookkeeping, like the
sweeper's beat: no run changes and nothing is audited. Rows whose last beat is older than
PRUNE_AFTER are deleted by the next register or beat of any executor. The runs an executor
holds are read from the runs' leases (``recovery.executors``), never stored here."""

from __future__ import annotations

import os
import socket
from datetime import datetime, timedelta
from functools import cache
from importlib import metadata

from recovery import clock, registry
from recovery.models import Executor, ExecutorMode

from ._core import default_owner

PRUNE_AFTER = timedelta(days=1)  # a row not beaten for this long is forgotten


@cache
def code_version() -> str:
    """The installed package's version ("0.1.0"), or "unknown" when it is not installed."""
    try:
        return metadata.version("recovery-console")
    except metadata.PackageNotFoundError:
        return "unknown"


def _identity(owner: str) -> dict[str, object]:
    host, _, pid = owner.rpartition(":")
    if not host or not pid.isdigit():  # an owner a test chose: this process's host and pid
        host, pid = socket.gethostname(), str(os.getpid())
    return {"host": host, "pid": int(pid)}


def _workflows() -> dict[str, list[int]]:
    return {name: list(versions) for name, versions in registry.deployed()}


def executor_register(*, mode: str, owner: str | None = None, now: datetime | None = None) -> Executor:
    """Record that the executor ``owner`` (its lease owner; this process's by default) started
    now, in ``mode`` (``ExecutorMode``), with this code's version and workflows. A row of the same
    owner (a pid reused on the same host) starts over."""
    if mode not in ExecutorMode.values:
        raise ValueError(f"no executor mode {mode!r} (one of {', '.join(ExecutorMode.values)})")
    now = now or clock.now()
    owner = owner or default_owner()
    executor, _ = Executor.objects.update_or_create(
        owner=owner,
        defaults={
            **_identity(owner),
            "mode": mode,
            "version": code_version(),
            "workflows": _workflows(),
            "started_at": now,
            "last_beat_at": now,
            "stopped_at": None,
        },
    )
    executors_prune(now=now)
    return executor


def executor_beat(*, mode: str, owner: str | None = None, now: datetime | None = None) -> None:
    """Record that the executor ``owner`` is alive now: registers it if it has no row yet (a
    Celery worker's first sweep, or a row pruned or removed meanwhile)."""
    now = now or clock.now()
    owner = owner or default_owner()
    if not Executor.objects.filter(owner=owner).update(last_beat_at=now, stopped_at=None):
        executor_register(mode=mode, owner=owner, now=now)
        return
    executors_prune(now=now)


def executor_stop(*, owner: str | None = None, now: datetime | None = None) -> None:
    """Record that the executor ``owner`` exited cleanly now: it is no longer expected to beat."""
    now = now or clock.now()
    Executor.objects.filter(owner=owner or default_owner()).update(last_beat_at=now, stopped_at=now)


def executors_prune(*, now: datetime | None = None) -> int:
    """Forget the executors that have not beaten for PRUNE_AFTER. Returns how many."""
    now = now or clock.now()
    deleted, _ = Executor.objects.filter(last_beat_at__lt=now - PRUNE_AFTER).delete()
    return deleted
