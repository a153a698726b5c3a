"""Benchmark the audit trail export, as an auditor gets it, against PostgreSQL's own COPY.

    .venv/bin/python bench/export.py                        # 200,000 events; sizes 10,000 and all
    .venv/bin/python bench/export.py --reuse bench_console_1m --sizes 10000,all
                                                            # the 10,000,000 events of bench/console.py's
                                                            # 1M-run database (or --runs 1000000: seeds it)

It seeds a throw-away database with ``bench/seed.py`` (``--runs``, ten audit events per run;
``--reuse NAME`` uses, and on first use seeds, the database NAME), then for each size in
``--sizes`` (a number of events, or ``all``) exports the oldest events of the trail, ``until`` the
``at`` of the first event past the size, in each format (CSV, JSON Lines), four ways:

- ``COPY``: PostgreSQL's ``COPY (SELECT …the export's columns, the same join with the run, the
  same order…) TO STDOUT`` (CSV with a header; JSON Lines as ``json_build_object`` rows), read by
  psycopg's ``cursor.copy()``: the ceiling;
- ``http``: ``GET /audit/export?format=…&until=…`` from gunicorn (``config.wsgi``, one sync worker,
  production settings, 127.0.0.1) with a supervisor's session (``manage.py createoperator``, then
  ``/login/`` with its CSRF token), read by the benchmark 1 MiB at a time. A fresh server for each
  measurement, so the worker's peak resident set (``VmHWM`` in /proc, read once the response is
  complete) is this export's;
- ``command``: ``manage.py export_audit --format … --until …`` with stdout piped to the benchmark;
  its peak resident set is ``ru_maxrss`` from ``wait4``. Its time includes the process's start
  (Django set-up, about a second: ``start s``, measured by exporting two events), which
  dominates at 10,000 events; ``vs COPY`` and the targets compare its streaming rate, rows over
  the time without that start (``rows/s`` keeps it in; the JSON has both ratios).

It prints rows/s, the ratio to COPY of the same format (target: at least 0.5) and the peak
resident set of the serving process (target: flat, the largest size within 50 MB of the
smallest), then one line of JSON. Lines are counted (no seeded text holds a newline) and must
equal COPY's rows. The caches are warmed by one unmeasured COPY first. The load average before
and after is in the JSON: another CPU-heavy process on this two-core machine makes every
figure noisy. Every server stops at the end; a throw-away database is dropped unless ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from urllib.parse import urlencode

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg  # noqa: E402

from bench import seed  # noqa: E402
from bench.server import Server, Session, create_supervisor, memory_kib  # noqa: E402

FORMATS = ("csv", "jsonl")
RATIO_TARGET = 0.5
FLAT_TARGET_MB = 50.0
FROM = """FROM recovery_auditevent e JOIN recovery_workflowrun r ON r.id = e.run_id
          WHERE ({until} IS NULL OR e.at < {until}) ORDER BY e.at, e.id"""
COPY_SQL = {
    "csv": "COPY (SELECT e.at, r.workflow_id, r.workflow_name, e.step_name, e.actor, e.action, e.reason, e.before, "
    "e.after, e.id, e.prev_hash, e.hash " + FROM + ") TO STDOUT (FORMAT csv, HEADER)",
    "jsonl": "COPY (SELECT json_build_object('at', e.at, 'workflow_id', r.workflow_id, 'workflow', r.workflow_name, "
    "'step', e.step_name, 'actor', e.actor, 'action', e.action, 'reason', e.reason, 'before', e.before, "
    "'after', e.after, 'event_id', e.id, 'prev_hash', e.prev_hash, 'hash', e.hash) " + FROM + ") TO STDOUT",
}


@dataclass(frozen=True)
class Cut:
    """The oldest ``rows`` events: those before ``until`` (None: all of them)."""

    label: str
    until: datetime | None
    rows: int
    runs: int = 0  # the runs those events belong to: the export's trailer has a line for each, and a total


@dataclass
class Result:
    cut: Cut
    path: str  # COPY, http or command
    format: str
    rows: int
    bytes: int
    seconds: float
    peak_rss_kib: int | None = None
    base_rss_kib: int | None = None
    startup: float = 0.0  # a command's own start (Django set-up): included in seconds, shown apart

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0

    @property
    def streaming_rate(self) -> float:
        """Rows per second once streaming: a command's own start-up left out."""
        seconds = self.seconds - self.startup
        return self.rows / seconds if seconds > 0 else 0.0


def cuts(db_url: str, sizes: list[str]) -> list[Cut]:
    out = []
    with psycopg.connect(db_url, autocommit=True) as conn:
        total = conn.execute("SELECT count(*) FROM recovery_auditevent").fetchone()[0]  # type: ignore[index]
        for size in sizes:
            if size == "all" or int(size) >= total:
                runs = conn.execute("SELECT count(DISTINCT run_id) FROM recovery_auditevent").fetchone()[0]  # type: ignore[index]
                out.append(Cut(f"all ({total:,})", None, total, runs))
                continue
            until = conn.execute(
                "SELECT at FROM recovery_auditevent ORDER BY at, id OFFSET %s LIMIT 1", (int(size),)
            ).fetchone()[0]  # type: ignore[index]
            rows, runs = conn.execute(
                "SELECT count(*), count(DISTINCT run_id) FROM recovery_auditevent WHERE at < %s", (until,)
            ).fetchone()  # type: ignore[misc]
            out.append(Cut(f"{int(size):,}", until, rows, runs))
    return out


def count_lines(chunks: Iterable[bytes]) -> tuple[int, int]:
    lines = size = 0
    for chunk in chunks:
        lines += chunk.count(b"\n")
        size += len(chunk)
    return lines, size


def data_rows(fmt: str, lines: int) -> int:
    return lines - 1 if fmt == "csv" else lines  # the CSV header


def exported_rows(cut: Cut, fmt: str, lines: int) -> int:
    """An export's events: its lines but the CSV header and the trailer (a line per run, the total)."""
    return data_rows(fmt, lines) - (cut.runs + 1)


def by_copy(db_url: str, cut: Cut, fmt: str) -> Result:
    statement = COPY_SQL[fmt].format(until="%(until)s")
    with psycopg.connect(db_url, autocommit=True) as conn, conn.cursor() as cur:
        started = time.perf_counter()
        rows = size = 0
        with cur.copy(statement, {"until": cut.until}) as copy:  # type: ignore[arg-type]
            for row in copy:
                rows += 1
                size += len(row)
        elapsed = time.perf_counter() - started
    return Result(cut, "COPY", fmt, data_rows(fmt, rows), size, elapsed)


def export_params(cut: Cut, fmt: str) -> dict[str, str]:
    return {"format": fmt, **({"until": cut.until.isoformat()} if cut.until else {})}


def by_http(db_url: str, work: Path, user: tuple[str, str], cut: Cut, fmt: str, warm: Cut) -> Result:
    with Server(db_url, work, workers=1) as server:
        session = Session(server.port)
        session.login(*user)
        count_lines(session.stream("/audit/export?" + urlencode(export_params(warm, fmt))))  # imports, connection
        (worker,) = server.worker_pids()
        base = memory_kib(worker, "VmRSS")
        started = time.perf_counter()
        lines, size = count_lines(session.stream("/audit/export?" + urlencode(export_params(cut, fmt))))
        elapsed = time.perf_counter() - started
        peak = memory_kib(worker, "VmHWM")
    return Result(cut, "http", fmt, exported_rows(cut, fmt, lines), size, elapsed, peak, base)


def by_command(db_url: str, cut: Cut, fmt: str, startup: float = 0.0) -> Result:
    argv = [sys.executable, seed.MANAGE, "export_audit", "--format", fmt]
    if cut.until:
        argv += ["--until", cut.until.isoformat()]
    started = time.perf_counter()
    process = subprocess.Popen(argv, cwd=seed.ROOT, env=seed.django_env(db_url), stdout=subprocess.PIPE)
    assert process.stdout is not None
    lines, size = count_lines(iter(lambda: process.stdout.read(1 << 20), b""))  # type: ignore[union-attr]
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"export_audit exited {process.returncode}")
    return Result(cut, "command", fmt, exported_rows(cut, fmt, lines), size, elapsed, usage.ru_maxrss, startup=startup)


def mb(kib: int | None) -> str:
    return "" if kib is None else f"{kib / 1024:.1f}"


def print_table(results: list[Result]) -> None:
    copies = {(r.cut.label, r.format): r for r in results if r.path == "COPY"}
    print(f"{'events':<18}{'path':<9}{'format':<7}{'rows':>12}{'MB':>9}{'s':>8}{'rows/s':>10}{'vs COPY':>9}"
          f"{'peak RSS MB':>13}{'before MB':>10}{'start s':>9}")  # fmt: skip
    print("-" * 114)
    for r in results:
        ratio = r.streaming_rate / copies[(r.cut.label, r.format)].rate
        print(
            f"{r.cut.label:<18}{r.path:<9}{r.format:<7}{r.rows:>12,}{r.bytes / 1e6:>9.1f}{r.seconds:>8.2f}"
            f"{r.rate:>10,.0f}{ratio:>8.2f}x{mb(r.peak_rss_kib):>13}{mb(r.base_rss_kib):>10}"
            f"{f'{r.startup:.2f}' if r.startup else '':>9}"
        )


def verdict(results: list[Result], cut_list: list[Cut]) -> dict:
    copies = {(r.cut.label, r.format): r for r in results if r.path == "COPY"}
    largest, smallest = cut_list[-1].label, cut_list[0].label
    at_largest = [r for r in results if r.path != "COPY" and r.cut.label == largest]
    ratios = {
        f"{r.path} {r.format}": round(r.streaming_rate / copies[(r.cut.label, r.format)].rate, 3) for r in at_largest
    }
    with_startup = {f"{r.path} {r.format}": round(r.rate / copies[(r.cut.label, r.format)].rate, 3) for r in at_largest}
    peaks = {(r.path, r.format, r.cut.label): r.peak_rss_kib or 0 for r in results if r.path != "COPY"}
    growth = {
        f"{path} {fmt}": round((peaks[(path, fmt, largest)] - peaks[(path, fmt, smallest)]) / 1024, 1)
        for path, fmt, label in peaks
        if label == largest
    }
    mismatched = [
        f"{r.path} {r.format} {r.cut.label}: {r.rows} rows, COPY {copies[(r.cut.label, r.format)].rows}"
        for r in results
        if r.rows != copies[(r.cut.label, r.format)].rows
    ]
    return {
        "ratio_vs_copy_at_largest": ratios,
        "ratio_vs_copy_at_largest_with_command_startup": with_startup,
        "ratio_target_holds": all(v >= RATIO_TARGET for v in ratios.values()),
        "rss_growth_mb_smallest_to_largest": growth,
        "rss_flat": all(v <= FLAT_TARGET_MB for v in growth.values()),
        "row_count_mismatches": mismatched,
    }


def run(args: argparse.Namespace) -> int:
    load_before = os.getloadavg()
    with seed.bench_run(args, prefix="bench_export") as (db, work):
        seed.manage(db.url, "migrate", "--noinput")
        user = create_supervisor(db.url)
        cut_list = sorted(cuts(db.url, args.sizes.split(",")), key=lambda c: c.rows)
        warm = Cut("warm-up", cuts(db.url, ["2"])[0].until, 2)
        seed.log(f"warming the caches: COPY of {cut_list[-1].label} events")
        by_copy(db.url, cut_list[-1], "csv")
        formats = args.formats.split(",")
        startup = {fmt: min(by_command(db.url, warm, fmt).seconds for _ in range(3)) for fmt in formats}
        seed.log("export_audit start-up (2 events): " + ", ".join(f"{k} {v:.2f}s" for k, v in startup.items()))
        results: list[Result] = []
        for cut in cut_list:
            for fmt in formats:
                for path in args.paths.split(","):
                    seed.log(f"{cut.label} events, {fmt}, {path}")
                    if path == "copy":
                        results.append(by_copy(db.url, cut, fmt))
                    elif path == "http":
                        results.append(by_http(db.url, work, user, cut, fmt, warm))
                    else:
                        results.append(by_command(db.url, cut, fmt, startup[fmt]))
                    seed.log(f"  {results[-1].rows:,} rows in {results[-1].seconds:.1f}s")
        print_table(results)
        targets = verdict(results, cut_list)
        summary = {
            "database": db.name,
            "audit_events": db.info["audit"],
            "results": [
                {
                    "events": r.cut.label,
                    "path": r.path,
                    "format": r.format,
                    "rows": r.rows,
                    "bytes": r.bytes,
                    "seconds": round(r.seconds, 3),
                    "rows_per_s": round(r.rate),
                    "startup_s": round(r.startup, 3),
                    "peak_rss_mb": None if r.peak_rss_kib is None else round(r.peak_rss_kib / 1024, 1),
                }
                for r in results
            ],
            "targets": targets,
            "all_targets_hold": targets["ratio_target_holds"]
            and targets["rss_flat"]
            and not targets["row_count_mismatches"],
        }
        seed.print_summary(summary, load_before)
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    seed.add_database_arguments(parser, default_runs=20_000, prefix="bench_export")
    parser.add_argument("--sizes", default="10000,all", help="events per export, smallest first: N,…,all")
    parser.add_argument("--paths", default="copy,http,command", help="which exports to measure (copy must be one)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="csv,jsonl (both)")
    args = parser.parse_args()
    if "copy" not in args.paths.split(","):
        parser.error("--paths must include copy: the other paths are compared to it")
    sys.exit(run(args))


if __name__ == "__main__":
    main()
