"""Liveness and readiness, for ``/healthz``, ``/readyz`` and ``manage.py check_health``.

Ready means: the database answers and every migration is applied; the broker answers when runs
are advanced by Celery (``RECOVERY_EXECUTOR=celery``); and a sweeper (Celery beat's sweep, or an
embedded executor) has looked for due work within ``RECOVERY_READY_BEAT_SECONDS``. Each check
says what it found in a few words — never a host, a URL, a user or a password."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from celery import current_app
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.db.migrations.executor import MigrationExecutor

from recovery import clock
from recovery.models import SweeperBeat

BROKER_TIMEOUT = 2.0  # seconds a readiness check waits for the broker

_migrated = False  # once every migration was found applied, this process does not look again


def live() -> dict[str, Any]:
    return {"status": "ok"}


def ready(now: datetime | None = None) -> dict[str, Any]:
    """``{"status": "ok" | "fail", "checks": {name: {"ok": bool, "detail": str}}}``."""
    now = now or clock.now()
    checks = {"database": _database()}
    if checks["database"]["ok"]:
        checks["migrations"] = _migrations()
    if checks.get("migrations", {}).get("ok"):  # before they are applied, the beat's table may not exist
        checks["sweeper"] = _sweeper(now)
    if settings.RECOVERY_EXECUTOR == "celery":
        checks["broker"] = _broker()
    return {"status": "ok" if all(c["ok"] for c in checks.values()) else "fail", "checks": checks}


def _check(ok: bool, detail: str) -> dict[str, Any]:
    return {"ok": ok, "detail": detail}


def _database() -> dict[str, Any]:
    try:
        with connections[DEFAULT_DB_ALIAS].cursor() as cursor:
            cursor.execute("SELECT 1")
    except DatabaseError as exc:
        connections[DEFAULT_DB_ALIAS].close()
        return _check(False, f"unreachable ({type(exc).__name__})")
    return _check(True, "answers")


def _migrations() -> dict[str, Any]:
    global _migrated
    if not _migrated:
        executor = MigrationExecutor(connections[DEFAULT_DB_ALIAS])
        unapplied = executor.migration_plan(executor.loader.graph.leaf_nodes())
        if unapplied:
            return _check(False, f"{len(unapplied)} migration(s) not applied: run manage.py migrate")
        _migrated = True
    return _check(True, "all applied")


def _sweeper(now: datetime) -> dict[str, Any]:
    beat = SweeperBeat.objects.order_by("-at").first()
    if beat is None:
        return _check(False, "no sweeper has run yet (celery beat, or manage.py run_executor)")
    age = (now - beat.at).total_seconds()
    detail = f"{beat.name} swept {age:.0f} s ago"
    if age > settings.RECOVERY_READY_BEAT_SECONDS:
        return _check(False, f"{detail}, more than {settings.RECOVERY_READY_BEAT_SECONDS:.0f} s")
    return _check(True, detail)


def _broker() -> dict[str, Any]:
    try:
        with current_app.connection_for_write(settings.CELERY_BROKER_URL) as connection:
            connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=BROKER_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - any failure to reach it means not ready
        return _check(False, f"unreachable ({type(exc).__name__})")
    return _check(True, "answers")
