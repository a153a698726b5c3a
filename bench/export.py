"""Benchmark the audit export: rows/s and peak Python memory for N events, against loading the
same columns at once (``list(AuditEvent.objects.values_list(...))``), measured in the same run.

    .venv/bin/python bench/export.py [N] [--database-url URL]

By default it builds a throw-away SQLite database in a temporary directory. ``--database-url``
(e.g. ``postgres://postgres@127.0.0.1:5432/recovery_bench``) must name an existing scratch
database with no audit events yet: the bench migrates it, writes N events and deletes them
afterwards. Throughput is timed without tracing; peak memory is measured in a second pass under
``tracemalloc`` (which slows Python several times), so a run takes a while for the default N.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("at", "run__workflow_id", "run__workflow_name", "step_name", "actor", "action", "reason", "before", "after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("events", nargs="?", type=int, default=200_000, help="number of audit events (200000)")
    parser.add_argument("--database-url", help="a scratch database (default: a temporary SQLite file)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        os.environ["DATABASE_URL"] = args.database_url or f"sqlite:///{tmp}/bench.sqlite3"
        os.environ["SANDBOX_DATABASE_URL"] = f"sqlite:///{tmp}/sandbox.sqlite3"
        os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings"
        os.environ["DJANGO_DEBUG"] = "0"  # no query log
        os.environ.setdefault("DJANGO_SECRET_KEY", "bench")
        sys.path.insert(0, str(ROOT))
        import django

        django.setup()
        run_bench(args.events)


def run_bench(n: int) -> None:
    from django.core.management import call_command
    from django.db import connection

    from recovery import exports
    from recovery.models import AuditEvent, WorkflowRun

    call_command("migrate", verbosity=0)
    if AuditEvent.objects.exists():
        sys.exit("the database already holds audit events: give the bench a scratch database")
    print(f"{connection.vendor}: writing {n} audit events…", file=sys.stderr)
    t0 = datetime(2024, 5, 1, tzinfo=UTC)
    run = WorkflowRun.objects.create(
        workflow_id="bench:export",
        workflow_name="bench",
        workflow_version=1,
        input={},
        input_hash="0" * 64,
        created_at=t0,
        updated_at=t0,
    )
    for start in range(0, n, 10_000):
        AuditEvent.objects.bulk_create(
            AuditEvent(
                run=run,
                at=t0 + timedelta(milliseconds=i),
                step_name="create_task",
                actor="executor",
                action="step_succeed",
                reason="the receiver answered 201 with the task it created for this approval",
                before={"run": "running", "step": "running", "attempts": i},
                after={"run": "running", "step": "succeeded", "remote_ref": f"task-{i}"},
            )
            for i in range(start, min(n, start + 10_000))
        )

    def baseline() -> int:
        return len(list(AuditEvent.objects.order_by("at", "id").values_list(*COLUMNS)))

    def export(fmt: str) -> Callable[[], int]:
        def consume() -> int:
            lines = 0
            for chunk in exports.export_chunks(exports.parse_filters({"format": fmt})):
                lines += chunk.count("\n")
            return lines

        return consume

    try:
        results = {"values_list": measure(baseline)}
        for fmt in exports.FORMATS:
            results[f"export {fmt}"] = measure(export(fmt))
    finally:
        run.delete()  # cascades to its audit events

    base_rate, base_peak = results["values_list"]
    print(f"{n} events on {connection.vendor}, batches of {exports.BATCH_SIZE}")
    print(f"{'':<14}{'rows/s':>10}{'vs list':>9}{'peak MiB':>10}{'vs list':>9}")
    for name, (rate, peak) in results.items():
        print(f"{name:<14}{rate:>10,.0f}{rate / base_rate:>8.2f}x{peak / 2**20:>10.1f}{peak / base_peak:>8.3f}x")


def measure(work: Callable[[], int]) -> tuple[float, int]:
    """(rows per second untraced, peak traced bytes)."""
    started = time.perf_counter()
    rows = work()
    rate = rows / (time.perf_counter() - started)
    tracemalloc.start()
    try:
        work()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return rate, peak


if __name__ == "__main__":
    main()
