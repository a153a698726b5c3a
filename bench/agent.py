"""An agent step's overhead per tool call, against a plain step, as a ratio measured in the same run.

    .venv/bin/python bench/agent.py                      # 200 runs x 3 calls, 3 repetitions (about 30 s)
    .venv/bin/python bench/agent.py --runs 500 --calls 5 --repeat 5
    .venv/bin/python bench/agent.py --database-url sqlite:////tmp/bench-agent.sqlite3 --runs 50

Workload (``bench/agent_workflow.py``, K = ``--calls``): ``bench_plain`` is K plain steps
(``effect="none"``, ``rerun=Rerun.YES``), each returning ``{"n": i}``; ``bench_agent`` is one agent
step whose scripted model (a pure function of the conversation, no network) asks for one tool call
per turn until K were made, then answers the final JSON; the tool returns ``{"n": i}`` too. A plain
run is K step rows; an agent run is the agent's row, K + 1 turn rows and K call rows.

One worker process (Django set up once, on the bench's environment) makes 10 untimed runs of each
workflow, then ``--repeat`` repetitions of: ``--runs`` runs of ``bench_plain`` and ``--runs`` runs
of ``bench_agent``, in alternating order (so that neither is always first), each run started and
driven to completion with ``recovery.engine.executor.start_and_advance``, one at a time, as a
Celery worker does for ``start_run``. The clock of a measurement spans its N runs, start included:
the run's insert, every transition and its journal rows, the scripted model and the work. Not in
it: Django's start-up, the warm-up, the statistics reads around it. Per repetition:

plain ms/step   the plain measurement's time / (N * K)
agent ms/call   the agent measurement's time / (N * K): the turns' cost is charged to the calls
ratio           agent ms/call / plain ms/step (the JSON's ``agent_overhead_ratio``: of the medians)
stmts           SQL statements Django sent on its connections during the measurement (a
                ``connection.execute_wrapper`` counter, on while timed: queries and savepoints,
                not BEGIN/COMMIT), per run and per step or call; ``SQL ms`` their time as the
                client saw it (round trips included, and the commit of a statement autocommitted
                on its own, but not the COMMIT of an ``atomic()`` block)
commits         PostgreSQL only: ``pg_stat_database.xact_commit`` of the bench's database, per run
                (the worker flushes its statistics with ``pg_stat_force_next_flush()`` before each
                read; reads included, as Django autocommits each query outside ``atomic()``;
                autovacuum may add a few)
CPU ms          the worker process's CPU time, per run (not the database server's)

Each run is checked: ``start_and_advance`` must let go of it completed; at the end every run of
both workflows must be completed, every plain run hold K succeeded step rows, every agent run its
agent row, K + 1 turn rows and K call rows, all succeeded. Else the bench fails.

Environment, as ``bench/executor.py``'s ``ours_bare``: DJANGO_DEBUG=0 (no query log),
DATABASE_CONN_MAX_AGE=60, RECOVERY_METRICS=0, RECOVERY_LOG_FORMAT=text at INFO (the worker's
stderr goes to a log file, shown on failure), RECOVERY_EXECUTOR=embedded, the sandbox database a
temporary SQLite file, ``RECOVERY_WORKFLOW_MODULES=workflows.registry,bench.agent_workflow``.

Isolation: on PostgreSQL (default: DATABASE_URL, else postgres://postgres@127.0.0.1:5432/postgres)
only the server is used: a fresh database ``bench_agent_<pid>`` is created, migrated and dropped at
the end (``WITH (FORCE)``), also on failure. ``--database-url sqlite:///PATH``: PATH must not exist;
it is created, migrated and deleted at the end.

Output: progress on stderr; on stdout a table (each repetition and the medians) and, last, one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the ``bench`` namespace package, also when run as bench/agent.py
from bench.executor import DEFAULT_ADMIN_URL, PY, BenchError, Children, Server, log  # noqa: E402
from bench.executor_workers import FLUSH_STATS, setup_django  # noqa: E402

KINDS = ("plain", "agent")  # workflows bench_plain and bench_agent
WARMUP = 10  # untimed runs of each workflow before the first measurement
WORKFLOW_MODULES = "workflows.registry,bench.agent_workflow"


@dataclass(frozen=True)
class Sample:
    kind: str
    rep: int
    runs: int
    calls: int
    seconds: float
    statements: int
    sql_seconds: float
    cpu_seconds: float
    commits: int | None  # None: not PostgreSQL

    @property
    def ms_per_run(self) -> float:
        return 1000 * self.seconds / self.runs

    @property
    def ms_per_call(self) -> float:
        """Per plain step, or per tool call (the agent's turns charged to its calls)."""
        return self.ms_per_run / self.calls

    @property
    def statements_per_run(self) -> float:
        return self.statements / self.runs

    @property
    def statements_per_call(self) -> float:
        return self.statements_per_run / self.calls

    @property
    def sql_ms_per_run(self) -> float:
        return 1000 * self.sql_seconds / self.runs

    @property
    def cpu_ms_per_run(self) -> float:
        return 1000 * self.cpu_seconds / self.runs

    @property
    def commits_per_run(self) -> float | None:
        return None if self.commits is None else self.commits / self.runs


# --- the worker (Django set up on the bench's environment) ----------------------------------


def worker(runs: int, calls: int, repeat: int) -> None:
    """Prints ``sample <json>`` per measurement, then ``verified``."""
    setup_django()
    from django.db import connection

    from bench.agent_workflow import CALLS

    if CALLS != calls:
        raise BenchError(f"BENCH_AGENT_CALLS is {CALLS}, the bench asked for {calls}")
    stats = Server(os.environ["DATABASE_URL"]) if connection.vendor == "postgresql" else None
    for kind in KINDS:
        for i in range(WARMUP):
            _run(kind, f"warm-{i}")
    for rep in range(repeat):
        for kind in KINDS if rep % 2 == 0 else KINDS[::-1]:
            sample = _measure(kind, rep, runs, calls, stats)
            print("sample", json.dumps(asdict(sample)), flush=True)
    _verify(runs * repeat + WARMUP, calls)
    print("verified", flush=True)
    if stats is not None:
        stats.admin.close()
    connection.close()


def _run(kind: str, run_id: str) -> None:
    from recovery.engine.executor import start_and_advance

    _, state = start_and_advance(workflow=f"bench_{kind}", data={"id": run_id})
    if state != "completed":
        raise BenchError(f"bench_{kind} run {run_id}: let go of as {state!r}, not completed")


def _measure(kind: str, rep: int, runs: int, calls: int, stats: Server | None) -> Sample:
    from django.db import connection, connections

    from bench.querycount import QueryCounter

    database = connection.settings_dict["NAME"]
    ids = [f"r{rep}-{i}" for i in range(runs)]
    counter = QueryCounter(keep_sql=False)
    before = _commits(stats, database)
    with _wrapped(connections.all(), counter):
        cpu = time.process_time()
        began = time.perf_counter()
        for run_id in ids:
            _run(kind, run_id)
        seconds = time.perf_counter() - began
        cpu = time.process_time() - cpu
    after = _commits(stats, database)
    # The second flush is one transaction of the measurement's window.
    commits = None if stats is None else after - before - 1
    return Sample(kind, rep, runs, calls, seconds, counter.count, counter.seconds, cpu, commits)


@contextmanager
def _wrapped(conns: list[Any], counter: Any) -> Iterator[None]:
    """``counter`` as the execute wrapper of every connection (the sandbox's too, if used)."""
    if not conns:
        yield
        return
    with conns[0].execute_wrapper(counter), _wrapped(conns[1:], counter):
        yield


def _commits(stats: Server | None, database: str) -> int:
    """``xact_commit`` of the database once this process's pending statistics are flushed."""
    if stats is None:
        return 0
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(FLUSH_STATS)  # flushed before the backend says it is ready for the next query
    return stats.xacts(database)[0]


def _verify(expected: int, calls: int) -> None:
    """Every run completed; each plain run K succeeded steps; each agent run its agent row, K + 1
    turns and K calls, all succeeded."""
    from recovery.models import StepExecution, WorkflowRun
    from recovery.workflow import parse_journal_name

    for kind in KINDS:
        name = f"bench_{kind}"
        states = Counter(WorkflowRun.objects.filter(workflow_name=name).values_list("state", flat=True))
        if states != {"completed": expected}:
            raise BenchError(f"{name}: runs by state {dict(states)}, expected {expected} completed")
        rows: dict[int, Counter] = {}
        for run, step, state in StepExecution.objects.filter(run__workflow_name=name).values_list(
            "run_id", "step_name", "state"
        ):
            if kind == "plain":
                row = "step"
            elif ":" not in step:
                row = "agent"
            else:
                row = "call" if parse_journal_name(step).tool else "turn"
            rows.setdefault(run, Counter())[(row, state)] += 1
        want = (
            Counter({("step", "succeeded"): calls})
            if kind == "plain"
            else Counter({("agent", "succeeded"): 1, ("turn", "succeeded"): calls + 1, ("call", "succeeded"): calls})
        )
        wrong = [(run, dict(got)) for run, got in rows.items() if got != want]
        if len(rows) != expected or wrong:
            raise BenchError(
                f"{name}: {len(rows)} runs with rows, {len(wrong)} not as expected {dict(want)}: {wrong[:3]}"
            )


# --- the bench --------------------------------------------------------------------------


@contextmanager
def throwaway_database(url: str) -> Iterator[tuple[str, str]]:
    """A fresh database: (its DATABASE_URL, a description of the server); removed at the end."""
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        path = Path(parts.path[1:]).resolve()  # as dj_database_url reads sqlite:///PATH
        if path.name in ("", ":memory:") or path.exists():
            raise BenchError(f"--database-url {url}: give a file that does not exist yet (it is deleted at the end)")
        try:
            import sqlite3

            yield f"sqlite:///{path}", f"SQLite {sqlite3.sqlite_version}"
        finally:
            for leftover in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
                leftover.unlink(missing_ok=True)
        return
    server = Server(url)
    server.prefix = "bench_agent"
    try:
        database = server.create(str(os.getpid()))  # bench_agent_<pid>
        yield server.url(database), f"PostgreSQL {server.version()}"
    finally:
        server.drop_all()
        server.admin.close()


def django_env(database_url: str, tmp: Path, calls: int) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    return {
        **environ,
        "BENCH_AGENT_CALLS": str(calls),
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "DJANGO_DEBUG": "0",
        "DJANGO_SECRET_KEY": "bench-agent",
        "DATABASE_URL": database_url,
        "SANDBOX_DATABASE_URL": f"sqlite:///{tmp / 'sandbox.sqlite3'}",
        "DATABASE_CONN_MAX_AGE": "60",
        "RECOVERY_EXECUTOR": "embedded",
        "RECOVERY_WORKFLOW_MODULES": WORKFLOW_MODULES,
        "RECOVERY_METRICS": "0",
        "RECOVERY_LOG_FORMAT": "text",
    }


def measure(args: argparse.Namespace, database_url: str, tmp: Path, children: Children) -> list[Sample]:
    """Migrates the database, then the worker's measurements, in the order made."""
    env = django_env(database_url, tmp, args.calls)
    subprocess.run([PY, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)
    argv = [PY, "-m", "bench.agent", "--worker", "--runs", str(args.runs), "--calls", str(args.calls)]
    child = children.start("worker", [*argv, "--repeat", str(args.repeat)], env)
    deadline = time.monotonic() + 120 + args.runs * args.repeat * args.calls  # a hang guard
    samples = []
    for _ in range(2 * args.repeat):
        sample = Sample(**json.loads(child.expect("sample", deadline).split(maxsplit=1)[1]))
        log(
            f"rep {sample.rep + 1} {sample.kind}: {sample.ms_per_run:.2f} ms/run, "
            f"{sample.statements_per_run:.1f} statements/run, {sample.seconds:.2f} s"
        )
        samples.append(sample)
    child.expect("verified", deadline)
    child.wait(60)
    return samples


# --- report -----------------------------------------------------------------------------


def report(samples: list[Sample], args: argparse.Namespace, machine: str) -> None:
    by = {(s.kind, s.rep): s for s in samples}
    ratios = [by["agent", rep].ms_per_call / by["plain", rep].ms_per_call for rep in range(args.repeat)]

    def median(kind: str, metric: str) -> float | None:
        values = [getattr(s, metric) for s in samples if s.kind == kind]
        return None if None in values else statistics.median(values)

    print(
        f"agent overhead benchmark: {args.runs} runs per measurement, K={args.calls} plain steps "
        f"or tool calls (+{args.calls + 1} model turns) per run, {args.repeat} repetition(s)"
    )
    print(machine)
    header = ("", "kind", "ms/run", "ms/step|call", "stmts/run", "stmts/step|call", "SQL ms/run", "CPU ms/run")
    widths = (8, 6, 9, 14, 11, 17, 12, 12, 13)
    print("".join(f"{h:>{w}}" for h, w in zip((*header, "commits/run"), widths, strict=True)))
    metrics = (
        "ms_per_run",
        "ms_per_call",
        "statements_per_run",
        "statements_per_call",
        "sql_ms_per_run",
        "cpu_ms_per_run",
        "commits_per_run",
    )
    rows = [(f"rep {s.rep + 1}", s.kind, *(getattr(s, m) for m in metrics)) for s in samples]
    rows += [("median", kind, *(median(kind, m) for m in metrics)) for kind in KINDS]
    for row in rows:
        cells = [f"{row[0]:>8}", f"{row[1]:>6}"]
        cells += ["-".rjust(w) if v is None else f"{v:>{w}.2f}" for v, w in zip(row[2:], widths[2:], strict=True)]
        print("".join(cells))
    plain_step, agent_call = median("plain", "ms_per_call"), median("agent", "ms_per_call")
    ratio = agent_call / plain_step
    print(
        f"agent ms per tool call / plain ms per step: {ratio:.2f} (of the medians; per repetition "
        f"{min(ratios):.2f} to {max(ratios):.2f})"
    )
    result = {
        "plain_ms_per_step": round(plain_step, 3),
        "agent_ms_per_call": round(agent_call, 3),
        "agent_overhead_ratio": round(ratio, 3),
        "agent_overhead_ratio_min": round(min(ratios), 3),
        "agent_overhead_ratio_max": round(max(ratios), 3),
        "plain_statements_per_step": round(median("plain", "statements_per_call"), 2),
        "agent_statements_per_call": round(median("agent", "statements_per_call"), 2),
        "plain_ms_per_run": round(median("plain", "ms_per_run"), 3),
        "agent_ms_per_run": round(median("agent", "ms_per_run"), 3),
        "plain_commits_per_run": _rounded(median("plain", "commits_per_run")),
        "agent_commits_per_run": _rounded(median("agent", "commits_per_run")),
        "database": machine.split(",", 1)[0],
        "runs": args.runs,
        "calls": args.calls,
        "repeat": args.repeat,
    }
    print(json.dumps(result))


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


# --- main -------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="N, runs of each workflow per measurement (200)")
    parser.add_argument("--calls", type=int, default=3, help="K, plain steps or tool calls per run (3)")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions of both measurements (3)")
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL") or DEFAULT_ADMIN_URL)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the child, on its environment
    args = parser.parse_args()
    if args.runs < 1 or args.calls < 1 or args.repeat < 1:
        parser.error("--runs, --calls and --repeat must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args.runs, args.calls, args.repeat)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the clean-up below runs
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        children = Children(Path(tmp))
        try:
            with throwaway_database(args.database_url) as (database_url, server):
                log(f"{server}: a fresh database, migrated; then {args.runs} runs of each workflow per repetition")
                try:
                    samples = measure(args, database_url, Path(tmp), children)
                finally:
                    children.stop_all()  # before the database is dropped
        except (BenchError, subprocess.CalledProcessError, psycopg.Error) as exc:
            sys.exit(f"bench/agent.py: {exc}")
    machine = (
        f"{server}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"load average {load:.1f} at the start and {os.getloadavg()[0]:.1f} at the end"
    )
    report(samples, args, machine)


if __name__ == "__main__":
    main()
