"""Executor throughput: our engine's embedded executor against DBOS Transact, a plain Celery chain and
a two-commits-per-step psycopg loop, on the same PostgreSQL, with 1, 2 and 4 worker processes.

    .venv/bin/pip install -e '.[bench]'      # dbos (pinned in pyproject.toml's bench extra)
    .venv/bin/python bench/executor.py              # a few minutes: 500 workflows, workers 1,2,4, one repetition
    .venv/bin/python bench/executor.py --full       # docs/performance.md's figures: 2,000 workflows, 3 repetitions
    .venv/bin/python bench/executor.py --workflows 1000 --workers 2 --repeat 5 --only ours,dbos

Workload: M workflows (``--workflows``) of three side-effecting steps; each step inserts one row
keyed by its idempotency key (the engine's ``sha256(workflow_id:step:v1)``) into
``bench_effect(key text primary key, run, step, at)`` with ``ON CONFLICT (key) DO NOTHING``. Every
measurement ends by checking that the table holds exactly 3*M rows and, for the durable
contenders, that all M workflows completed. Steps/s is 3*M over the wall time from the moment
every worker process is ready (started, connected, set up) and told to go, until the last one
has done its share; process start-up and teardown are not timed.

The contenders, each with N worker processes (``--workers``, default 1,2,4):

ours     The production code path: M runs started in bulk with ``recovery.engine.transitions.run_start``
         *before* timing, once per invocation into a template database (that time, one process,
         is printed under the table and is not in steps/s), then N OS processes, each calling
         ``recovery.engine.loop.run_forever(until_idle=True, poll_seconds=0.05)`` after
         ``django.setup()``, i.e. ``manage.py run_executor --until-idle --poll 0.05`` without
         Django's start-up inside the timing, until nothing is due. The workflow is
         ``bench/executor_workflow.py``, registered with
         ``RECOVERY_WORKFLOW_MODULES=workflows.registry,bench.executor_workflow``. Its steps are
         local steps (``local=True``): the insert is made on Django's connection inside the
         transaction that records the step's outcome, as one writes a step whose effect is in the
         engine's own database — the three steps are consecutive local steps, so their effects,
         attempts and outcomes commit together: one commit per run after its claim, where the
         ceiling makes two per step (nothing needs committing before an effect that only exists
         once committed). Children run with
         DJANGO_DEBUG=0 (no query log) and DATABASE_CONN_MAX_AGE=60; the embedded sandbox
         database is a temporary SQLite file.
ours_bare  Exactly ours, but with RECOVERY_METRICS=0 (no counter, no histogram, no multiprocess
         file) and plain-text logs. The other engine contenders observe as production does:
         metrics recorded by each worker process into one PROMETHEUS_MULTIPROC_DIR, logs as JSON
         (RECOVERY_LOG_FORMAT=json) at INFO. Its purpose is the ``observability cost`` below.
ours_anyversion  Exactly ours, but with the claim's version filter removed (BENCH_VERSION_FILTER=off):
         in each worker process ``bench/executor_workflow.py``, imported by ``django.setup()``,
         replaces ``recovery.registry.deployed_filter`` with a function returning an empty ``Q()``
         and clears ``transitions.leases._pick_sql``'s cache before anything claims, so the claim
         (and the publisher's look-up of due messages, which this workload has none of) takes a
         run of any (workflow, version); a switch of the bench's alone, no setting. The other
         engine contenders run with BENCH_VERSION_FILTER=on: their claim tests each (name,
         version) the workers have — the bench workflow and ``workflows.registry``'s (invoice v1
         and v2, dispute), an OR of one term per name. After its claims each worker reads the
         statement back from ``_pick_sql``'s cache (a hit, or it fails) and checks that it has
         the filter or lacks it as switched; its ``done`` line says so, and the report prints
         it. Its purpose is the ``version filter cost`` below.
ours_call  The same, with the steps declared as ordinary calls (BENCH_STEPS=call): the insert
         commits on its own outside any transaction, as a call to another system would, then
         the outcome is checkpointed — three commits per step.
ours_call_nohb  Exactly ours_call, but with the heartbeat off (BENCH_HEARTBEAT=off): in each worker
         process ``bench/executor_workflow.py``, imported by ``django.setup()``, replaces
         ``recovery.engine.heartbeat.held_run`` and ``held_claim`` with no-op context managers before the
         executor runs (a switch of the bench's alone, no setting). The other engine contenders run
         with BENCH_HEARTBEAT=on. Its purpose is the ``heartbeat cost`` below: local steps do not go
         through the heartbeat, calls do (rule 12), so ours_call pays it and this one does not.
ours_call_anyversion  Exactly ours_call, but with the version filter removed, as ours_anyversion:
         the ``version filter cost call`` below.
ours_e2e  End to end, the way DBOS is counted: nothing is started before the clock. Each of the N
         processes takes its share of the M events (``i ≡ k mod N``) and, one at a time, starts and
         advances the run with ``executor.start_and_advance``, which is what a Celery worker does
         for ``start_run`` (the run is written already claimed by the process, so no claim
         follows). Then ``run_forever(until_idle=True)`` for anything let go of meanwhile. Local
         steps, as ours.
ours_call_e2e  The same with the steps as calls, as ours_call. The JSON line's ``e2e_*`` keys and the
         "end to end" lines compare these two with DBOS, whose clock includes its workflow start.
dbos     DBOS Transact (the ``dbos`` package, 3.x): a ``@DBOS.workflow`` calling three
         ``@DBOS.step`` s. Steps, not transactions: DBOS 3 removed ``@DBOS.transaction`` with the
         application database (its successor, a datasource transaction, runs SERIALIZABLE and
         commits the checkpoint in the row's transaction), and our engine's step is an ordinary
         call that makes an idempotent effect under a key, which is exactly a DBOS step; each
         step inserts on an autocommit connection of its own. Several processes: each of the N
         processes launches DBOS on the same system database (its own executor id) and runs its
         share of the M workflows (``i ≡ k mod N``) by calling the workflow function directly,
         one at a time, as our executor runs one run at a time. So DBOS's workflow start (its
         status row) is inside the timing, where ours is not. A DBOS queue was not used: its
         workers poll (default every second) and take at most ``worker_concurrency`` workflows
         per poll, which measures the polling interval rather than the engine. DBOS runs with
         its defaults, including ``pool_pre_ping``: SQLAlchemy pings each connection it checks
         out with an autocommitted ``SELECT 1``, one more commit per DBOS transaction.
celery   A chain of three tasks doing the same inserts, no durability (early acks, no result
         backend), on a Redis of the bench's own (``redis-server --port <free> --bind 127.0.0.1
         --save '' --appendonly no``, stopped at the end). One ``celery worker -c N`` (prefork:
         N pool processes and their parent). The M chains are enqueued before timing while the
         worker consumes only an empty queue; timing starts with ``add_consumer`` and stops
         when the parent, polling ``count(*)``, sees 3*M rows.
ceiling  A plain psycopg loop, N processes, two commits per step: INSERT the intent into
         ``bench_checkpoint`` and COMMIT; then the effect INSERT and the outcome UPDATE, COMMIT.

Transactions: every contender gets a fresh database per measurement (cloned from a template that
holds its schema and, for ours, the started runs), so ``pg_stat_database`` counts that database
alone. ``xact_commit`` and ``xact_rollback`` are read before ``go`` and after the last backend
on the database has gone, each read after ``pg_stat_clear_snapshot()``. Statistics reach the
shared counters asynchronously (a busy backend flushes at most once a second, an idle one after
ten seconds, an exiting one at once), so each worker runs ``pg_stat_force_next_flush()`` on its
connections before it says ready, which puts its set-up before the first read, and the second
read waits until ``pg_stat_activity`` shows no client backend on the database (a backend
flushes before it leaves it). DBOS's background threads keep some pooled connections checked
out; a DBOS worker waits 2.5 s after launch so that their set-up is flushed too. Their steady
work (queue, scheduler and notification polling, with pre-pings: about a dozen transactions a
second per process) is part of DBOS's cost and stays in; the boundaries can shift about one
second of it. The Celery poller's own queries (one unprepared, autocommitted transaction each)
are counted and subtracted. psycopg's server-side prepare of a statement run five times on a
connection is one more transaction, once per connection and statement: kept, as a real cost.
Autovacuum may add a few transactions.

``pg commits/step`` is xact_commit / (3*M), reads included: Django runs in autocommit, so each
query outside ``atomic()`` is a transaction of its own. ``commits_per_step`` (ours only) is the
engine's share: (commits - 3*M) / (3*M), the 3*M being the effect inserts, each autocommitted
on its own (one per step). The ceiling's is 2. ``worker CPU ms/step`` is the CPU time of the
worker processes (all their threads, not PostgreSQL's) from ``go`` to ``done``, per step: with
steps/s it tells a contender that waits on the database from one that computes (not measured
for Celery's pool processes). ``pg CPU ms/step`` is the CPU time (user and system, from
``/proc/<pid>/stat``) of the PostgreSQL backends serving the measurement's database, from ``go``
to ``done``, per step: the server's share of the work, log flushes included (not its WAL writer,
checkpointer or autovacuum, which serve every database). Only when the server runs on this
machine (a ``127.0.0.1``/``localhost`` URL whose backends' pids are ``postgres`` processes
here); a backend that connects after ``go`` counts from its start, one that leaves before
``done`` is missed (workers keep their connections until the bench has read them; not
measured for Celery). On a
machine whose cores are all busy, steps/s is bounded by (worker + pg CPU) per step: the sum
compares contenders' costs where steps/s compares their speed.

What each clock includes: ours, ours_bare, ours_anyversion, ours_call, ours_call_nohb and
ours_call_anyversion run runs started before the clock (``pre-started``: the executor alone);
ours_e2e and ours_call_e2e start every run inside it; DBOS starts every workflow inside it;
Celery's chains are enqueued before it (its clock is the consumption); the ceiling has no start.

Latency: after each measurement of ours* or DBOS, bench/latency.py reads every step's and run's
latency from the engine's own records (our audit events' ``at``, DBOS's ``operation_outputs``
and ``workflow_status`` times) and keeps p50/p95/p99. A step's latency is the time from the
run's previous checkpoint (its durable start: the claim, or the start where the clock includes
it, or the previous step's outcome; for DBOS its workflow row or its previous step's output) to
its outcome recorded, each engine's clock read as it writes the checkpoint; ``intent`` is from
the step's own start (our call step's ``step_begin``, DBOS's ``started_at_epoch_ms``) to its
outcome; a run's is from its start (its claim if pre-started) to its completion recorded. Local
steps share one commit, so the first of the three carries it and the next two are short; compare
runs end to end. bench/latency.py's docstring has the details, and also the machine: cores and
model, memory, Python, PostgreSQL, load average at the start and end.

Output: progress on stderr; on stdout a table (median and min–max over ``--repeat`` repetitions
per contender and worker count), the latency table (medians of each repetition's percentiles,
ms), the ratios ours/other of the medians, and, as the last line, one JSON object with the
2-worker medians (or the first measured worker count without 2), ``step_latency_ms``,
``step_intent_latency_ms`` and ``run_latency_ms`` (contender: count, p50, p95, p99) among them,
and ``machine``.
With both ours_call and ours_call_nohb, also the heartbeat's cost per worker count:
``heartbeat_cost`` = 1 - (ours_call steps/s / ours_call_nohb steps/s), of the medians, with the
min–max of the same ratio per repetition (the two are measured back to back in each repetition,
in alternating order, so that the machine's slow patches hit both alike); in the JSON line,
``heartbeat_cost`` and ``heartbeat_cost_min``/``_max`` map each worker count to them. With both
ours and ours_bare, ``observability_cost`` likewise (1 - ours / ours_bare); with ours and
ours_anyversion, ``version_filter_cost`` (1 - ours / ours_anyversion; the line also gives the
ratio ours/ours_anyversion itself), and with ours_call and ours_call_anyversion,
``version_filter_cost_call``. Each cost line also gives the two contenders' median CPU per
step, worker processes and PostgreSQL backends together, which another process's load stretches
much less than the wall time (``<cost>_cpu`` in the JSON: 1 - without / with, of those). Where
two pairs share a contender (ours with ours_bare and with ours_anyversion), a pair's two are not
always back to back, but still in the same repetition and in alternating order. Run a cost's
pair alone (``--only ours,ours_anyversion``) with ``--repeat`` of 6 or more for a figure: a few
percent is within one repetition's noise on a shared machine.

Isolation: only the *server* of ``--database-url`` (default DATABASE_URL, else
postgres://postgres@127.0.0.1:5432/postgres) is used, through its ``postgres`` maintenance
database; every database the bench makes is called ``bench_executor_<pid>_…``, and all are
dropped (``DROP DATABASE … WITH (FORCE)``) at the end, also on failure. Every child runs in its
own process group and is stopped at the end; every server binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the ``bench`` namespace package, also when run as bench/executor.py
from bench import latency  # noqa: E402
from bench.executor_workers import FLUSH_STATS  # noqa: E402

PY = sys.executable
CONTENDERS = (
    "ours",
    "ours_bare",
    "ours_anyversion",
    "ours_call",
    "ours_call_nohb",
    "ours_call_anyversion",
    "ours_e2e",
    "ours_call_e2e",
    "ours_api",
    "dbos",
    "celery",
    "ceiling",
)
# Our contenders: how the bench workflow declares its steps.
ENGINE = {
    "ours": "local",
    "ours_bare": "local",
    "ours_anyversion": "local",
    "ours_call": "call",
    "ours_call_nohb": "call",
    "ours_call_anyversion": "call",
    "ours_e2e": "local",
    "ours_call_e2e": "call",
    "ours_api": "local",
}
# Those whose clock includes every run's start (as DBOS's includes its workflow's start), each
# with its pre-started twin.
E2E = {"ours_e2e": "ours", "ours_call_e2e": "ours_call", "ours_api": "ours"}
API_WORKERS = 2  # gunicorn's sync workers serving the event API (ours_api)
API_BATCH = 100  # events per request
HEARTBEAT_OFF = {"ours_call_nohb"}
BARE = {"ours_bare"}
VERSION_FILTER_OFF = {"ours_anyversion", "ours_call_anyversion"}
# What a feature costs: 1 - (steps/s with it / steps/s without it), from two contenders that
# differ by it alone and are measured in the same repetition (in alternating order).
COSTS = {
    "heartbeat_cost": ("ours_call", "ours_call_nohb"),
    "observability_cost": ("ours", "ours_bare"),
    "version_filter_cost": ("ours", "ours_anyversion"),
    "version_filter_cost_call": ("ours_call", "ours_call_anyversion"),
}
DEFAULT_ADMIN_URL = "postgres://postgres@127.0.0.1:5432/postgres"
EFFECT_TABLE = (
    "CREATE TABLE bench_effect (key text PRIMARY KEY, run text NOT NULL, step text NOT NULL, "
    "at timestamptz NOT NULL DEFAULT now())"
)
CHECKPOINT_TABLE = (
    "CREATE TABLE bench_checkpoint (key text PRIMARY KEY, run text NOT NULL, step text NOT NULL, "
    "state text NOT NULL, remote_ref text, updated_at timestamptz NOT NULL DEFAULT now())"
)
COUNT_EFFECTS = "SELECT count(*) FROM bench_effect"
COUNT_COMPLETED = "SELECT count(*) FROM recovery_workflowrun WHERE state = 'completed'"
# Per durable contender: (finished workflows, all workflows).
FINISHED = {
    **dict.fromkeys(ENGINE, "SELECT count(*) FILTER (WHERE state = 'completed'), count(*) FROM recovery_workflowrun"),
    "dbos": "SELECT count(*) FILTER (WHERE status = 'SUCCESS'), count(*) FROM dbos.workflow_status",
    "ceiling": "SELECT count(*) FILTER (WHERE succeeded = 3), count(*) FROM "
    "(SELECT count(*) FILTER (WHERE state = 'succeeded') AS succeeded FROM bench_checkpoint GROUP BY run) AS runs",
}
POLL_SECONDS = 0.02  # how often the parent counts what Celery, or ours_api, has done


class BenchError(Exception):
    pass


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# --- measurements ----------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    contender: str
    workers: int
    seconds: float
    steps: int
    commits: int
    rollbacks: int
    worker_cpu: float | None  # CPU seconds of the worker processes (not PostgreSQL's), None for Celery
    rep: int = 0  # the repetition, from 0
    pg_cpu: float | None = None  # CPU seconds of the database's PostgreSQL backends, None if not measured
    latency: dict[str, dict[str, float]] | None = None  # bench/latency.py's summaries, durable engines only

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds

    @property
    def commits_per_step(self) -> float:
        return self.commits / self.steps

    @property
    def rollbacks_per_step(self) -> float:
        return self.rollbacks / self.steps

    @property
    def cpu_ms_per_step(self) -> float | None:
        return None if self.worker_cpu is None else 1000 * self.worker_cpu / self.steps

    @property
    def pg_cpu_ms_per_step(self) -> float | None:
        return None if self.pg_cpu is None else 1000 * self.pg_cpu / self.steps

    @property
    def engine_commits_per_step(self) -> float | None:
        """Ours only: the engine's commits. A local step's insert commits with its outcome; a
        called step's insert commits on its own (one per step, not the engine's)."""
        if self.contender not in ENGINE:
            return None
        return (self.commits - (self.steps if ENGINE[self.contender] == "call" else 0)) / self.steps


@dataclass(frozen=True)
class Summary:
    samples: list[Sample]

    def median(self, metric: Callable[[Sample], Any]) -> float:
        return statistics.median(metric(s) for s in self.samples)

    def spread(self, metric: Callable[[Sample], float]) -> tuple[float, float]:
        values = [metric(s) for s in self.samples]
        return min(values), max(values)


# --- child processes -------------------------------------------------------------------


class Child:
    """A process in its own group, stdin/stdout piped for the ready/go/done protocol, stderr to a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with self.log_path.open("wb") as stderr:
            self.proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                start_new_session=True,
            )
        self._buffer = b""

    def expect(self, word: str, deadline: float) -> str:
        """Read stdout lines until one starts with ``word``; returns that line."""
        while True:
            line = self._next_line(deadline)
            if line.split(maxsplit=1)[:1] == [word]:
                return line

    def _next_line(self, deadline: float) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(f"{self.name}: no answer in time{self.log_tail()}")
            if select.select([fd], [], [], remaining)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise BenchError(f"{self.name}: exited with {self.proc.wait()}{self.log_tail()}")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def send(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{word}\n".encode())
        self.proc.stdin.flush()

    def wait(self, timeout: float) -> None:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{self.name}: did not exit in time{self.log_tail()}") from None
        if code != 0:
            raise BenchError(f"{self.name}: exited with {code}{self.log_tail()}")

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.returncode is not None:
            return  # reaped already, after it exited by itself: its group id may belong to someone else now
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait()
        self._signal(signal.SIGKILL)  # members left (a group id is not reused while one lives)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def log_tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()[-15:]
        return "".join(f"\n    {line}" for line in lines)


class Children:
    """Every child the bench starts, so that all of them are stopped at the end."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self._all: list[Child] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> Child:
        child = Child(name, argv, env, self.log_dir)
        self._all.append(child)
        return child

    def stop_all(self) -> None:
        for child in self._all:
            child.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the PostgreSQL server -------------------------------------------------------------


class Server:
    """Throw-away databases on one PostgreSQL server, administered through its ``postgres`` database."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.scheme not in ("postgres", "postgresql"):
            raise BenchError(f"--database-url must be a PostgreSQL URL, not {parts.scheme!r}")
        self._parts = parts
        self.admin = psycopg.connect(self.url("postgres"), autocommit=True)
        self.prefix = f"bench_executor_{os.getpid()}"
        self._created: list[str] = []

    def url(self, database: str) -> str:
        return urlunsplit(self._parts._replace(path=f"/{database}", query="", fragment=""))

    def version(self) -> str:
        return self.admin.execute("SHOW server_version").fetchone()[0]

    def create(self, name: str, *, template: str | None = None) -> str:
        database = f"{self.prefix}_{name}"
        self._created.append(database)
        clause = f' TEMPLATE "{template}"' if template else ""
        self.admin.execute(f'CREATE DATABASE "{database}"{clause}')
        return database

    def drop(self, database: str) -> None:
        self.admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        self._created.remove(database)

    def drop_all(self) -> None:
        for database in list(self._created):
            self.drop(database)

    def wait_idle(self, database: str, timeout: float = 60.0) -> None:
        """Until no client backend is connected to ``database``: each has flushed its statistics."""
        deadline = time.monotonic() + timeout
        query = "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend'"
        while self.admin.execute(query, [database]).fetchone()[0]:
            if time.monotonic() > deadline:
                raise BenchError(f"connections to {database} still open after {timeout:.0f} s")
            time.sleep(0.05)

    def wait_flushed(self, database: str, backends: int, timeout: float = 60.0) -> None:
        """Until ``backends`` connections to ``database`` are idle after ``FLUSH_STATS``: a backend
        flushes its statistics before it reports itself idle."""
        deadline = time.monotonic() + timeout
        query = "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND state = 'idle' AND query = %s"
        while self.admin.execute(query, [database, FLUSH_STATS]).fetchone()[0] < backends:
            if time.monotonic() > deadline:
                raise BenchError(f"fewer than {backends} connections to {database} ready after {timeout:.0f} s")
            time.sleep(0.05)

    def xacts(self, database: str) -> tuple[int, int]:
        self.admin.execute("SELECT pg_stat_clear_snapshot()")
        row = self.admin.execute(
            "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = %s", [database]
        ).fetchone()
        return int(row[0] or 0), int(row[1] or 0)

    def backends_cpu(self, database: str) -> dict[int, float] | None:
        """CPU seconds (user + system) each client backend on ``database`` has used so far, by
        pid, from ``/proc``; None unless the server runs on this machine."""
        if self._parts.hostname not in ("127.0.0.1", "localhost", "::1"):
            return None
        pids = self.admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend'", [database]
        ).fetchall()
        ticks = os.sysconf("SC_CLK_TCK")
        used = {}
        for (pid,) in pids:
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    is_postgres = cmdline.read().startswith(b"postgres")
            except FileNotFoundError:
                continue  # it has just left
            except OSError:
                return None
            if not is_postgres:
                return None  # another machine's pids
            used[pid] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        return used

    def execute(self, database: str, *statements: str) -> None:
        with psycopg.connect(self.url(database), autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)


# --- the bench -------------------------------------------------------------------------


@dataclass
class Bench:
    server: Server
    children: Children
    workflows: int
    tmp: Path
    broker_url: str = ""
    # Per engine contender, what its workers' claims filtered on (their ``done`` lines).
    claims: dict[str, set[str]] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return 3 * self.workflows

    def deadline(self) -> float:
        """A hang guard, far above any plausible measurement."""
        return time.monotonic() + 120 + self.workflows

    def django_env(
        self,
        database: str,
        steps: str = "local",
        heartbeat: bool = True,
        observed: bool = True,
        version_filter: bool = True,
    ) -> dict[str, str]:
        # Observed as in production: metrics in one multiprocess directory for every worker process, JSON logs.
        prometheus = self.tmp / "prometheus" / database
        prometheus.mkdir(parents=True, exist_ok=True)
        environ = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        return {
            "BENCH_STEPS": steps,
            **environ,
            **({"PROMETHEUS_MULTIPROC_DIR": str(prometheus)} if observed else {}),
            "RECOVERY_METRICS": "1" if observed else "0",
            "RECOVERY_LOG_FORMAT": "json" if observed else "text",
            "BENCH_HEARTBEAT": "on" if heartbeat else "off",
            "BENCH_VERSION_FILTER": "on" if version_filter else "off",
            "DJANGO_SETTINGS_MODULE": "config.settings",
            "DJANGO_DEBUG": "0",
            "DJANGO_SECRET_KEY": "bench-executor",
            "DATABASE_URL": self.server.url(database),
            "SANDBOX_DATABASE_URL": f"sqlite:///{self.tmp / 'sandbox.sqlite3'}",
            "DATABASE_CONN_MAX_AGE": "60",
            "RECOVERY_EXECUTOR": "embedded",
            "RECOVERY_WORKFLOW_MODULES": "workflows.registry,bench.executor_workflow",
        }

    # templates: one per contender and invocation, cloned for every measurement

    def template_ours(self) -> tuple[str, float]:
        """Migrated, with the effect table and M runs started; returns it and the start's seconds."""
        template = self.template_engine("ours_template")
        env = self.django_env(template)
        log(f"ours: starting {self.workflows} runs with run_start (one process, not timed)")
        starter = self.children.start(
            "ours-start", [PY, "-m", "bench.executor_workers", "start", *self._workflows_arg()], env
        )
        seconds = float(starter.expect("started", self.deadline()).split()[1])
        starter.wait(60)
        self.server.execute(template, "VACUUM ANALYZE")
        self.server.wait_idle(template)
        return template, seconds

    def template_engine(self, name: str) -> str:
        """Migrated, with the effect table, no run."""
        template = self.server.create(name)
        log(f"{name}: migrating the engine's template database")
        env = self.django_env(template)
        subprocess.run([PY, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)
        self.server.execute(template, EFFECT_TABLE)
        return template

    def template_dbos(self) -> str:
        from dbos import DBOS

        template = self.server.create("dbos_template")
        DBOS.migrate(self.server.url(template))
        self.server.execute(template, EFFECT_TABLE, "VACUUM ANALYZE")
        self.server.wait_idle(template)
        return template

    def template_plain(self, contender: str, *tables: str) -> str:
        template = self.server.create(f"{contender}_template")
        self.server.execute(template, *tables)
        return template

    # measurements

    def measure(self, contender: str, template: str, workers: int, rep: int) -> Sample:
        database = self.server.create(f"{contender}_w{workers}_r{rep}", template=template)
        try:
            pg_cpu = None
            if contender == "celery":
                seconds, commits, rollbacks, cpu = *self._run_celery(database, workers, rep), None
            elif contender == "ours_api":
                seconds, commits, rollbacks, cpu, pg_cpu = self._run_api(database, workers, rep)
            else:
                seconds, commits, rollbacks, cpu, pg_cpu = self._run_processes(contender, database, workers, rep)
            self._verify(contender, database)
            found = None  # read after the transaction counts: not counted
            if contender in ENGINE or contender == "dbos":
                engine = "dbos" if contender == "dbos" else "ours"
                found = latency.measure(self.server.url(database), engine=engine, prestarted=contender not in E2E)
                if found is None:
                    log(f"{contender}: no step latency found in its records (bench/latency.py)")
        finally:
            self.server.drop(database)
        return Sample(contender, workers, seconds, self.steps, commits, rollbacks, cpu, rep, pg_cpu, found)

    def _run_processes(
        self, contender: str, database: str, workers: int, rep: int
    ) -> tuple[float, int, int, float, float | None]:
        if contender in ENGINE:
            env = self.django_env(
                database,
                ENGINE[contender],
                heartbeat=contender not in HEARTBEAT_OFF,
                observed=contender not in BARE,
                version_filter=contender not in VERSION_FILTER_OFF,
            )
        else:
            env = dict(os.environ)
        procs = [
            self.children.start(
                f"{contender}-w{workers}-r{rep}-{k}", self._worker_argv(contender, database, k, workers), env
            )
            for k in range(workers)
        ]
        deadline = self.deadline()
        for proc in procs:
            proc.expect("ready", deadline)
        before = self.server.xacts(database)
        backends = self.server.backends_cpu(database)
        began = time.perf_counter()
        for proc in procs:
            proc.send("go")
        cpu = self._done(contender, procs, deadline)
        seconds = time.perf_counter() - began
        pg_cpu = _cpu_since(backends, self.server.backends_cpu(database))
        for proc in procs:
            proc.send("exit")
        for proc in procs:
            proc.wait(60)
        self.server.wait_idle(database)
        after = self.server.xacts(database)
        return seconds, after[0] - before[0], after[1] - before[1], cpu, pg_cpu

    def _done(self, contender: str, procs: list[Child], deadline: float) -> float:
        """Each worker's ``done <CPU seconds> [filter=… deployed=…]``: the CPU seconds of all, and
        (engine workers) what their claims' version filter tested, kept for the report."""
        cpu = 0.0
        for proc in procs:
            _, seconds, *detail = proc.expect("done", deadline).split()
            cpu += float(seconds)
            if detail:
                self.claims.setdefault(contender, set()).add(" ".join(detail))
        return cpu

    def _worker_argv(self, contender: str, database: str, index: int, workers: int) -> list[str]:
        share = ["--index", str(index), "--workers", str(workers), *self._workflows_arg()]
        if contender == "ours_api":
            return [PY, "-m", "bench.executor_workers", "ours_serve"]
        if contender in E2E:
            return [PY, "-m", "bench.executor_workers", "ours_e2e", *share]
        if contender in ENGINE:
            return [PY, "-m", "bench.executor_workers", "ours"]
        argv = [PY, "-m", "bench.executor_workers", contender]
        return [
            *argv,
            "--dsn",
            self.server.url(database),
            "--index",
            str(index),
            "--workers",
            str(workers),
            *self._workflows_arg(),
        ]

    def _workflows_arg(self) -> list[str]:
        return ["--workflows", str(self.workflows)]

    def _run_celery(self, database: str, workers: int, rep: int) -> tuple[float, int, int]:
        from bench import executor_celery

        executor_celery.app.conf.broker_url = self.broker_url  # the parent enqueues and controls
        worker, node = self._start_celery_worker(database, workers, rep)
        deadline = self.deadline()
        for i in range(self.workflows):
            executor_celery.workflow(i).apply_async()  # queued; the worker consumes only the parked queue
        with psycopg.connect(self.server.url(database), autocommit=True) as poller:
            poller.execute(FLUSH_STATS)
            self.server.wait_flushed(database, workers + 1)  # the pool processes and the poller
            before = self.server.xacts(database)
            began = time.perf_counter()
            executor_celery.app.control.add_consumer(executor_celery.QUEUE, destination=[node], reply=True, timeout=5)
            polls = poll(poller, COUNT_EFFECTS, self.steps, deadline, f"Celery's {self.steps} rows", worker.log_tail)
            seconds = time.perf_counter() - began
        worker.stop()
        self.server.wait_idle(database)
        after = self.server.xacts(database)
        return seconds, after[0] - before[0] - polls, after[1] - before[1]

    def _start_celery_worker(self, database: str, workers: int, rep: int) -> tuple[Child, str]:
        """One prefork worker with ``workers`` pool processes, consuming only an empty queue; returns
        it once it answers a ping, with its node name."""
        from bench import executor_celery

        node = f"bench{rep}w{workers}@{socket.gethostname()}"
        parked = f"{executor_celery.QUEUE}_parked"
        argv = [PY, "-m", "celery", "-A", "bench.executor_celery", "worker", "-P", "prefork", "-c", str(workers)]
        argv += ["-Q", parked, "-n", node, "-l", "WARNING", "--without-gossip", "--without-mingle"]
        env = {**os.environ, "BENCH_BROKER_URL": self.broker_url, "BENCH_EFFECT_DSN": self.server.url(database)}
        worker = self.children.start(f"celery-w{workers}-r{rep}", argv, env)
        deadline = time.monotonic() + 60
        while not executor_celery.app.control.ping(destination=[node], timeout=0.5):
            if time.monotonic() > deadline or worker.proc.poll() is not None:
                raise BenchError(f"the Celery worker did not answer{worker.log_tail()}")
        return worker, node

    def _run_api(self, database: str, workers: int, rep: int) -> tuple[float, int, int, float, float | None]:
        """The M events posted to the event API (gunicorn, API_WORKERS sync workers, token
        authentication, JSON arrays of API_BATCH) from three client threads while ``workers``
        executors serve; timed from ``go`` until every run has completed."""
        from bench.start import Gunicorn, _cpu_seconds, check_answers, issue_token, post_batches, server_env

        env = self.django_env(database)
        token = issue_token(env, f"bench-w{workers}-r{rep}")
        events = [{"id": str(i)} for i in range(self.workflows)]
        batches = [events[i : i + API_BATCH] for i in range(0, len(events), API_BATCH)]
        bodies = [json.dumps(batch).encode() for batch in batches]
        metrics = self.tmp / "prometheus" / f"{database}-api"
        metrics.mkdir(parents=True, exist_ok=True)
        server = Gunicorn(server_env(env, metrics), API_WORKERS, self.tmp / f"gunicorn-{database}.log")
        try:
            server.start()
            # Untimed: each worker answers once (imports, URL resolver); an event that does not validate
            # starts nothing.
            for status, _ in post_batches(server.port, token, [b"[{}]"] * 2 * API_WORKERS, 2):
                if status != 207:
                    raise BenchError(f"ours_api: the warm-up got HTTP {status}{server.log_tail()}")
            procs = [
                self.children.start(
                    f"ours_api-w{workers}-r{rep}-{k}", self._worker_argv("ours_api", database, k, workers), env
                )
                for k in range(workers)
            ]
            deadline = self.deadline()
            for proc in procs:
                proc.expect("ready", deadline)
            served = server.worker_pids()
            with psycopg.connect(self.server.url(database), autocommit=True) as poller:
                poller.execute(FLUSH_STATS)
                before = self.server.xacts(database)
                backends = self.server.backends_cpu(database)
                cpu_served = _cpu_seconds(served)
                began = time.perf_counter()
                for proc in procs:
                    proc.send("go")
                answers: list[tuple[int, bytes]] = []
                client = threading.Thread(
                    target=lambda: answers.extend(post_batches(server.port, token, bodies, 3)), name="api-client"
                )
                client.start()
                polls = poll(poller, COUNT_COMPLETED, self.workflows, deadline, "ours_api's runs", server.log_tail)
                seconds = time.perf_counter() - began
                client.join()
                cpu_served = _cpu_seconds(served) - cpu_served
                pg_cpu = _cpu_since(backends, self.server.backends_cpu(database))
            for proc in procs:
                proc.send("stop")
            cpu = self._done("ours_api", procs, deadline) + cpu_served
            for proc in procs:
                proc.send("exit")
            for proc in procs:
                proc.wait(60)
            check_answers(batches, answers)
        finally:
            server.stop()
        self.server.wait_idle(database)
        after = self.server.xacts(database)
        return seconds, after[0] - before[0] - polls, after[1] - before[1], cpu, pg_cpu

    def api_ingestion(self, template: str) -> float:
        """Events/s the event API takes alone (bench/start.py's measure_api: gunicorn with
        API_WORKERS sync workers, token, arrays of API_BATCH, no executor), into a clone of
        ``template``: ``max(M, 2000)`` events."""
        from bench.start import measure_api

        database = self.server.create("api_ingestion", template=template)
        try:
            log("event API alone: ingestion over HTTP")
            return measure_api(
                self.django_env(database), max(self.workflows, 2000), API_BATCH, "ingest", API_WORKERS, report=False
            )
        finally:
            self.server.drop(database)

    def _verify(self, contender: str, database: str) -> None:
        with psycopg.connect(self.server.url(database), autocommit=True) as conn:
            rows = conn.execute(COUNT_EFFECTS).fetchone()[0]
            if rows != self.steps:
                raise BenchError(f"{contender}: {rows} rows in bench_effect, expected {self.steps}")
            if contender in FINISHED:
                finished, total = conn.execute(FINISHED[contender]).fetchone()
                if finished != self.workflows or total != self.workflows:
                    raise BenchError(
                        f"{contender}: {finished} of {total} workflows finished, expected {self.workflows}"
                    )


def _cpu_since(before: dict[int, float] | None, after: dict[int, float] | None) -> float | None:
    """The backends' CPU seconds between two ``Server.backends_cpu`` readings (a backend new
    since the first counts from its start)."""
    if before is None or after is None:
        return None
    return sum(used - before.get(pid, 0.0) for pid, used in after.items())


def poll(conn: psycopg.Connection, count_sql: str, target: int, deadline: float, what: str, tail: Callable) -> int:
    """Until ``count_sql`` counts ``target``, every POLL_SECONDS; returns the queries it ran (each one
    transaction, unprepared: psycopg's server-side prepare would be one more)."""
    polls = 1
    while conn.execute(count_sql, prepare=False).fetchone()[0] < target:
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: not done in time{tail()}")
        time.sleep(POLL_SECONDS)
        polls += 1
    return polls


@contextmanager
def redis_server(children: Children) -> Iterator[str]:
    if not shutil.which("redis-server"):
        raise BenchError("the Celery contender needs redis-server on PATH (apt-get install redis-server)")
    import redis

    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    server = children.start("redis", argv, dict(os.environ))
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise BenchError(f"redis-server did not start{server.log_tail()}") from None
            time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        server.stop()


# --- report ----------------------------------------------------------------------------


def report(
    samples: list[Sample],
    args: argparse.Namespace,
    machine: dict[str, Any],
    start_seconds: float | None,
    api_rate: float | None = None,
    claims: dict[str, set[str]] | None = None,
) -> None:
    groups: dict[tuple[str, int], Summary] = {}
    for sample in samples:
        groups.setdefault((sample.contender, sample.workers), Summary([])).samples.append(sample)

    print(f"executor benchmark: {args.workflows} workflows x 3 steps, median (min-max) of {args.repeat} run(s)")
    print(latency.describe(machine))
    width = max([10, *(len(contender) + 1 for contender, _ in groups)])
    print(
        f"{'contender':<{width}}{'workers':>8}{'steps/s':>10}  {'min-max':<15}{'pg commits/step':>16}"
        f"{'rollbacks/step':>15}{'commits_per_step':>17}{'worker CPU ms/step':>20}{'pg CPU ms/step':>16}"
    )
    ordered = sorted(groups.items(), key=lambda g: (CONTENDERS.index(g[0][0]), g[0][1]))
    for (contender, workers), summary in ordered:
        low, high = summary.spread(lambda s: s.steps_per_s)
        print(
            f"{contender:<{width}}{workers:>8}{summary.median(lambda s: s.steps_per_s):>10.1f}  "
            f"{f'{low:.1f}-{high:.1f}':<15}{_cell(summary, lambda s: s.commits_per_step):>16}"
            f"{_cell(summary, lambda s: s.rollbacks_per_step):>15}"
            f"{_cell(summary, lambda s: s.engine_commits_per_step):>17}"
            f"{_cell(summary, lambda s: s.cpu_ms_per_step):>20}"
            f"{_cell(summary, lambda s: s.pg_cpu_ms_per_step):>16}"
        )
    for line in latency.table([(c, w, [s.latency for s in summary.samples]) for (c, w), summary in ordered]):
        print(line)
    for workers in args.workers:
        ratios = [
            f"ours/{other} {ratio:.2f}"
            for other in CONTENDERS[1:]
            if (ratio := _ratio(groups, workers, other)) is not None
        ]
        if ratios:
            print(f"ratios of medians, {workers} worker(s): " + ", ".join(ratios))
        e2e = [
            f"{ours}/dbos {ratio:.2f}" for ours in E2E if (ratio := _ratio(groups, workers, "dbos", ours)) is not None
        ]
        if e2e:
            print(f"end to end (every start inside the clock), {workers} worker(s): " + ", ".join(e2e))
        if lat := _latency_ratios(groups, workers):
            print(
                f"latency against DBOS (ours/dbos of the median percentiles, below 1 ours is quicker), "
                f"{workers} worker(s): {lat}"
            )
    for name, (on, off) in COSTS.items():
        for workers in args.workers:
            if (cost := feature_cost(samples, workers, on, off)) is not None:
                median, low, high = cost
                cpu = cpu_cost(samples, workers, on, off)
                cpu_text = f"; worker + pg CPU ms/step {cpu[0]:.3f} against {cpu[1]:.3f}" if cpu else ""
                print(
                    f"{name.replace('_', ' ')}, {workers} worker(s): {100 * median:.1f}% "
                    f"(1 - {on}/{off}, of the medians: {on}/{off} {1 - median:.3f}; "
                    f"per repetition {100 * low:.1f}% to {100 * high:.1f}%{cpu_text})"
                )
    if claims:
        print(
            "the claim's version filter, as each worker found it in its cached statement after its claims: "
            + "; ".join(f"{contender} {' | '.join(sorted(found))}" for contender, found in claims.items())
        )
    if start_seconds is not None:
        print(
            f"ours: run_start of {args.workflows} runs, one process, before timing: {start_seconds:.1f} s "
            f"({args.workflows / start_seconds:.0f} runs/s)"
        )
    if api_rate is not None:
        print(
            f"event API alone: {api_rate:.0f} events/s (gunicorn, {API_WORKERS} sync workers, token, "
            f"arrays of {API_BATCH}, 3 clients, no executor)"
        )
    print(json.dumps(summary_json(groups, args, start_seconds, samples, api_rate, machine)))


def _latency(groups: dict[tuple[str, int], Summary], contender: str, workers: int, figure: str) -> dict | None:
    summary = groups.get((contender, workers))
    return latency.median_of([s.latency for s in summary.samples], figure) if summary else None


def _latency_ratios(groups: dict[tuple[str, int], Summary], workers: int) -> str:
    """ours/dbos of the step and run p50 and p99, for the end-to-end contenders (whose clock
    starts where DBOS's does)."""
    parts = []
    for ours in ("ours_e2e", "ours_call_e2e"):
        for figure in ("step", "run"):
            mine, theirs = _latency(groups, ours, workers, figure), _latency(groups, "dbos", workers, figure)
            if mine and theirs and theirs["p50"] and theirs["p99"]:
                parts.append(
                    f"{ours} {figure} p50 {mine['p50'] / theirs['p50']:.2f} p99 {mine['p99'] / theirs['p99']:.2f}"
                )
    return ", ".join(parts)


def _cell(summary: Summary, metric: Callable[[Sample], float | None]) -> str:
    """The median of ``metric`` to two decimals, or "-" where it does not apply."""
    if any(metric(s) is None for s in summary.samples):
        return "-"
    return f"{summary.median(metric):.2f}"


def _median_rate(groups: dict[tuple[str, int], Summary], contender: str, workers: int) -> float | None:
    summary = groups.get((contender, workers))
    return summary.median(lambda s: s.steps_per_s) if summary else None


def feature_cost(
    samples: Sequence[Sample], workers: int, with_it: str, without_it: str
) -> tuple[float, float, float] | None:
    """1 - ``with_it`` steps/s / ``without_it`` steps/s at ``workers``: of the medians, then the
    min and max of the same ratio within each repetition (its two measurements are back to back)."""
    on = {s.rep: s.steps_per_s for s in samples if s.contender == with_it and s.workers == workers}
    off = {s.rep: s.steps_per_s for s in samples if s.contender == without_it and s.workers == workers}
    paired = [1 - on[rep] / off[rep] for rep in on.keys() & off.keys()]
    if not paired:
        return None
    return 1 - statistics.median(on.values()) / statistics.median(off.values()), min(paired), max(paired)


def cpu_cost(samples: Sequence[Sample], workers: int, with_it: str, without_it: str) -> tuple[float, float] | None:
    """The median CPU per step, worker processes and PostgreSQL backends together (ms), of ``with_it``
    and of ``without_it`` at ``workers``; None unless both were measured for every sample. Steadier
    than steps/s on a shared machine: another process's load stretches the wall time, much less
    the CPU a step takes."""

    def median(contender: str) -> float | None:
        cpu = [
            s.cpu_ms_per_step + s.pg_cpu_ms_per_step
            for s in samples
            if s.contender == contender and s.workers == workers
            if s.cpu_ms_per_step is not None and s.pg_cpu_ms_per_step is not None
        ]
        return statistics.median(cpu) if cpu else None

    on, off = median(with_it), median(without_it)
    return (on, off) if on is not None and off is not None else None


def _ratio(groups: dict[tuple[str, int], Summary], workers: int, other: str, ours: str = "ours") -> float | None:
    mine, theirs = _median_rate(groups, ours, workers), _median_rate(groups, other, workers)
    return mine / theirs if mine and theirs else None


def summary_json(
    groups: dict[tuple[str, int], Summary],
    args: argparse.Namespace,
    start_seconds: float | None,
    samples: Sequence[Sample] = (),
    api_rate: float | None = None,
    machine: dict[str, Any] | None = None,
) -> dict[str, Any]:
    workers = 2 if 2 in args.workers else args.workers[0]

    def median(contender: str, metric: Callable[[Sample], Any]) -> float | None:
        summary = groups.get((contender, workers))
        if summary is None or any(metric(s) is None for s in summary.samples):
            return None
        return round(summary.median(metric), 3)

    def ratio(other: str) -> float | None:
        value = _ratio(groups, workers, other)
        return round(value, 3) if value is not None else None

    result: dict[str, Any] = {
        "workers": workers,
        "workflows": args.workflows,
        "repeat": args.repeat,
        "steps_per_s": median("ours", lambda s: s.steps_per_s),
        "commits_per_step": median("ours", lambda s: s.engine_commits_per_step),
        "pg_commits_per_step": median("ours", lambda s: s.commits_per_step),
        "cpu_ms_per_step": median("ours", lambda s: s.cpu_ms_per_step),
        "pg_cpu_ms_per_step": median("ours", lambda s: s.pg_cpu_ms_per_step),
    }
    for other in CONTENDERS[1:]:
        result[f"{other}_steps_per_s"] = median(other, lambda s: s.steps_per_s)
        result[f"ratio_vs_{other}"] = ratio(other)
        result[f"{other}_pg_commits_per_step"] = median(other, lambda s: s.commits_per_step)
        if other != "celery":
            result[f"{other}_cpu_ms_per_step"] = median(other, lambda s: s.cpu_ms_per_step)
            result[f"{other}_pg_cpu_ms_per_step"] = median(other, lambda s: s.pg_cpu_ms_per_step)
    result["start_runs_per_s"] = round(args.workflows / start_seconds, 1) if start_seconds else None
    result["api_events_per_s"] = round(api_rate, 1) if api_rate else None
    # End to end: every run's start inside the clock, as DBOS's workflow start is in its.
    for ours, name in (("ours_e2e", "e2e"), ("ours_call_e2e", "e2e_call"), ("ours_api", "e2e_api")):
        result[f"{name}_steps_per_s"] = median(ours, lambda s: s.steps_per_s)
        result[f"{name}_ratio_vs_dbos"] = (
            round(value, 3) if (value := _ratio(groups, workers, "dbos", ours)) is not None else None
        )
        by_workers = {str(n): _ratio(groups, n, "dbos", ours) for n in args.workers}
        result[f"{name}_ratio_vs_dbos_by_workers"] = {
            n: round(ratio, 3) for n, ratio in by_workers.items() if ratio is not None
        } or None
    for name, (on, off) in COSTS.items():
        costs = {str(n): cost for n in args.workers if (cost := feature_cost(samples, n, on, off)) is not None}
        for key, index in ((name, 0), (f"{name}_min", 1), (f"{name}_max", 2)):
            result[key] = {n: round(cost[index], 4) for n, cost in costs.items()} or None
        cpus = {str(n): cpu for n in args.workers if (cpu := cpu_cost(samples, n, on, off)) is not None}
        result[f"{name}_cpu"] = {n: round(1 - off_ms / on_ms, 4) for n, (on_ms, off_ms) in cpus.items()} or None
    # Per durable contender at ``workers``: p50/p95/p99 and count (bench/latency.py), ms.
    for key, figure in (("step_latency_ms", "step"), ("step_intent_latency_ms", "intent"), ("run_latency_ms", "run")):
        found = {c: _latency(groups, c, workers, figure) for c in CONTENDERS}
        result[key] = {c: value for c, value in found.items() if value} or None
    result["machine"] = machine
    return result


# --- main ------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workflows", type=int, help="M, workflows per measurement (500; --full: 2000)")
    parser.add_argument("--workers", default="1,2,4", help="worker process counts, comma-separated (1,2,4)")
    parser.add_argument("--repeat", type=int, help="repetitions per contender and worker count (1; --full: 3)")
    parser.add_argument("--only", default=",".join(CONTENDERS), help=f"contenders ({','.join(CONTENDERS)})")
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL") or DEFAULT_ADMIN_URL)
    parser.add_argument("--full", action="store_true", help="2,000 workflows, 3 repetitions (docs/performance.md)")
    args = parser.parse_args()
    args.workflows = args.workflows or (2000 if args.full else 500)
    args.repeat = args.repeat or (3 if args.full else 1)
    args.workers = [int(n) for n in args.workers.split(",")]
    args.only = [c.strip() for c in args.only.split(",")]
    unknown = set(args.only) - set(CONTENDERS)
    if unknown or args.workflows < 1 or args.repeat < 1 or min(args.workers) < 1:
        parser.error(f"bad arguments (unknown contenders: {', '.join(sorted(unknown)) or 'none'})")
    return args


def run(args: argparse.Namespace, server: Server, children: Children, tmp: Path) -> None:
    bench = Bench(server=server, children=children, workflows=args.workflows, tmp=tmp)
    contenders = [c for c in CONTENDERS if c in args.only]
    templates: dict[str, str] = {}
    start_seconds = None
    if (set(ENGINE) - set(E2E)) & set(contenders):  # one template of started runs serves all of them
        template, start_seconds = bench.template_ours()
        templates.update(dict.fromkeys(set(ENGINE) - set(E2E), template))
    if set(E2E) & set(contenders):  # they start their own runs
        templates.update(dict.fromkeys(E2E, bench.template_engine("ours_e2e_template")))
    if "dbos" in contenders:
        templates["dbos"] = bench.template_dbos()
    if "celery" in contenders:
        templates["celery"] = bench.template_plain("celery", EFFECT_TABLE)
    if "ceiling" in contenders:
        templates["ceiling"] = bench.template_plain("ceiling", EFFECT_TABLE, CHECKPOINT_TABLE)

    load = os.getloadavg()[0]
    with redis_server(children) if "celery" in contenders else nullcontext("") as broker_url:
        bench.broker_url = broker_url
        samples = []
        # Interleaved, so that a slow patch of the machine does not land on one contender.
        for rep in range(args.repeat):
            for workers in args.workers:
                for contender in _order(contenders, rep):
                    sample = bench.measure(contender, templates[contender], workers, rep)
                    cpu = [sample.cpu_ms_per_step, sample.pg_cpu_ms_per_step]
                    log(
                        f"{contender} workers={workers} rep={rep + 1}: {sample.steps_per_s:.1f} steps/s, "
                        f"{sample.commits_per_step:.2f} commits/step, {sample.seconds:.2f} s"
                        + (f", worker + pg CPU {sum(cpu):.3f} ms/step" if None not in cpu else "")
                    )
                    samples.append(sample)
    api_rate = bench.api_ingestion(templates["ours_api"]) if "ours_api" in contenders else None
    machine = latency.machine(server.version(), load, os.getloadavg()[0])
    report(samples, args, machine, start_seconds, api_rate, bench.claims)


def _order(contenders: list[str], rep: int) -> list[str]:
    """The contenders in their order, except that the two of each pair in COSTS swap places every
    other repetition: neither is always the first of the pair. A pair's two are adjacent in
    CONTENDERS, or one apart where two pairs share a contender (ours with ours_bare and with
    ours_anyversion): swapped in turn, each pair still alternates."""
    ordered = list(contenders)
    if rep % 2:
        for on, off in COSTS.values():
            if on in ordered and off in ordered:
                i, j = ordered.index(on), ordered.index(off)
                ordered[i], ordered[j] = off, on
    return ordered


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the clean-up below runs
    server = Server(args.database_url)
    with tempfile.TemporaryDirectory(prefix="bench-executor-") as tmp:
        children = Children(Path(tmp))
        try:
            run(args, server, children, Path(tmp))
        except (BenchError, subprocess.CalledProcessError) as exc:
            sys.exit(f"bench/executor.py: {exc}")
        finally:
            children.stop_all()
            server.drop_all()
            server.admin.close()


if __name__ == "__main__":
    main()
