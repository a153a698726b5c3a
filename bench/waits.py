"""Durable waits at scale (issue 38): what W runs waiting for an event cost an executor that has
other work, or none, and how fast delivered events complete their runs. One process, one throw-away
PostgreSQL database, W = 0 and W = ``--waiting`` measured in the same run; figures, no asserts.

    .venv/bin/python bench/waits.py                            # W = 100,000 waiting, M = 1,000 runs (4.5 min here)
    .venv/bin/python bench/waits.py --waiting 2000 --runs 200  # a quick check (~1 min)

The requirement: "100,000 runs waiting cost the executor no per-run polling (its queries per second
do not grow with the number of waiting runs; measured), and delivering 1,000 events completes their
runs at the event API's rate."

Set-up. ``bench_waits_<pid>`` on the server of ``--database-url`` (default DATABASE_URL, else
postgres://postgres@127.0.0.1:5432/postgres), migrated in this process after ``django.setup()``,
dropped at the end, also on failure or SIGTERM. DJANGO_DEBUG=0, the embedded executor,
``RECOVERY_WORKFLOW_MODULES=workflows.registry,bench.waits_workflow`` (``bench_waits``: a local
step, a wait for the event ``go`` — 3 days, then review —, a local step; ``bench_plain``: the two
local steps alone), one connection throughout (DATABASE_CONN_MAX_AGE=3600, so the executor's
prepared claim outlives the test client's requests), logs at WARNING. A warm-up (untimed) takes
20 runs of each workflow through everything measured. Every figure below counts the SQL
statements on Django's connection (``connection.execute_wrapper``; the prepared claim included)
and drives the executor as ``manage.py run_executor`` does: ``recovery.engine.loop.run_forever``.

Each size, in order:

idle     Nothing due, only the W waiting runs: ``run_forever(poll_seconds=--poll)`` for
         ``--idle-seconds``. ``idle polls`` (rounds: one claim finding nothing, one look-up of due
         outbox messages, a beat every RECOVERY_SWEEP_SECONDS), ``idle queries/poll``, ``idle
         queries/s``, ``idle claim ms`` (median claim statement) and ``idle db ms/poll`` (all its
         statements' time per poll). No per-run polling: queries/poll is the same whatever W; the
         ms say what each poll costs the database.
claim    ``EXPLAIN (ANALYZE, BUFFERS)`` of the claim's pick (``transitions.leases._pick_sql``, the
         ``picked`` part of ``storage.claim``'s one statement, FOR UPDATE SKIP LOCKED, rolled back),
         as a custom plan (values inlined: the prepared claim's first five executions) and as the
         generic plan (``plan_cache_mode = force_generic_plan``: what it may run from the sixth).
         ``rows read``: run-table rows its scans returned or removed by a filter, all loops (as
         tests/engine/test_claim_paths.py counts them); ``buffers``: shared blocks hit + read. Taken
         idle (``idle claim``), with the M plain runs due (``due claim``) and after the events
         (``event claim``). The idle plans at the big size are printed.
plain    M ``bench_plain`` runs started (``run_start_many``, untimed; ids above every waiting run,
         as new work is), ``ANALYZE``, then ``run_forever(until_idle=True, poll_seconds=0.05)``
         timed: ``plain runs/s``, ``plain queries/run`` (claims, steps, the last idle round, beats)
         and ``plain claim ms`` (mean). All M must be completed.
events   M runs waiting at their wait each get one event through Django's test client, in this
         process (the view and its middleware; no HTTP server): ``POST /api/runs/<workflow
         id>/events``, a token of ``recovery.api.tokens.issue_token``, ``{"event": "go", "key": …,
         "payload": {}}``, each answered 201 (``events/s``, ``event queries`` per event); then the
         executor completes them, timed (``completed runs/s``, ``completed queries/run``); all M
         must be completed. ``complete/events`` = completed runs/s over events/s: at least 1, one
         executor keeps up with the event API.

Which runs wait. At W=0 the executor drives 2M ``bench_waits`` runs to their wait (``to-wait
runs/s``, ``to-wait queries/run``; all must be ``waiting``): M get W=0's events, the other M stay
waiting for the big size's. The big size then adds W - M waiting runs above them, copies of one of
those the engine left at its wait: every column of the run and its three steps as the engine wrote
it (state ``waiting``, ``next_wake_at`` three days on, no lease, status reason, revision; step one
succeeded, the wait step ``waiting`` until its deadline, step three pending), with each copy's own
workflow id, input, input hash (the engine's keyed hash) and idempotency keys (checked against
``recovery.contract.idempotency_key``), then ``ANALYZE``. Not copied: their audit events, which
nothing measured reads. The copy is one ``INSERT … SELECT`` per ``--batch`` runs over the ORM's
column list: the ORM's ``bulk_create`` built them in Python at about 1 ms a run (110 s for 100,000).
So the M runs that get the events are the oldest of the W: the claim that finds them walks none of
the others (``event claim rows read``). A due run younger than the waiting runs — every new run,
the plain runs here — is found after the ones below it in the claim's walk (``due claim``).

Output: progress on stderr; on stdout a table (W=0, W, and W over 0), the big size's idle claim
plans, a summary — saying plainly when the claim reads more rows with more runs waiting — and, last,
one JSON line with every figure. A run that did not end as it must prints FAIL and exits 1. Timing
on a shared machine is noisy: the rows read and queries per run do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the ``bench`` namespace package, also when run as bench/waits.py

from bench.querycount import QueryCounter  # noqa: E402

DEFAULT_ADMIN_URL = "postgres://postgres@127.0.0.1:5432/postgres"
WORKFLOWS = "workflows.registry,bench.waits_workflow"
CLAIM_MARK = "WITH picked AS"  # storage.claim's statement
WARM_UP = 20


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class BenchFailed(Exception):
    """A run that did not end as it must: printed as FAIL, exit status 1."""


class Counter(QueryCounter):
    """Every SQL statement on Django's connection while installed: how many, how long (the
    console bench's counter), the claims' times apart."""

    def __init__(self) -> None:
        super().__init__(keep_sql=False)
        self.claims: list[float] = []

    def observed(self, sql: str, params: Any, elapsed: float) -> None:
        if CLAIM_MARK in sql:
            self.claims.append(elapsed)


def counted(work: Callable[[], object]) -> tuple[Counter, float]:
    """Run ``work`` with every statement counted; the counter and the wall time."""
    from django.db import connection

    counter = Counter()
    with connection.execute_wrapper(counter):
        started = time.perf_counter()
        work()
        wall = time.perf_counter() - started
    return counter, wall


# --- set-up ------------------------------------------------------------------------------


def configure(url: str) -> None:
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "config.settings",
            "DJANGO_DEBUG": "0",
            "DJANGO_SECRET_KEY": os.environ.get("DJANGO_SECRET_KEY", "bench-waits-" + os.urandom(16).hex()),
            "DJANGO_ALLOWED_HOSTS": "testserver,127.0.0.1",
            "DJANGO_SECURE_SSL_REDIRECT": "0",
            "DATABASE_URL": url,
            "DATABASE_CONN_MAX_AGE": "3600",
            "SANDBOX_DATABASE_URL": "sqlite://:memory:",
            "RECOVERY_EXECUTOR": "embedded",
            "RECOVERY_WORKFLOW_MODULES": WORKFLOWS,
            "RECOVERY_LOG_LEVEL": "WARNING",
        }
    )
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", "--noinput", verbosity=0)


def analyze() -> None:
    from django.db import connection

    from recovery.models import StepExecution, WorkflowRun

    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {WorkflowRun._meta.db_table}, {StepExecution._meta.db_table}")


def start_runs(workflow: str, prefix: str, count: int) -> list[str]:
    """``count`` runs started with run_start_many (batches of 500); their workflow ids."""
    from recovery.engine.transitions import run_start_many

    events = [{"id": f"{prefix}-{i}"} for i in range(count)]
    for i in range(0, count, 500):
        run_start_many(workflow=workflow, events=events[i : i + 500])
    analyze()
    return [f"{workflow}:{e['id']}" for e in events]


def states(workflow_ids: list[str]) -> dict[str, int]:
    from django.db.models import Count

    from recovery.models import WorkflowRun

    rows = WorkflowRun.objects.filter(workflow_id__in=workflow_ids).values("state").annotate(n=Count("id"))
    return {row["state"]: row["n"] for row in rows}


def require(workflow_ids: list[str], state: str, what: str) -> None:
    found = states(workflow_ids)
    if found.get(state, 0) != len(workflow_ids):
        raise BenchFailed(f"{what}: {len(workflow_ids)} runs should be {state}, found {found}")


def drain() -> None:
    from recovery.engine.loop import run_forever

    run_forever(until_idle=True, poll_seconds=0.05)


def insert_waiting(count: int, prefix: str, template_pk: int, batch: int) -> float:
    """``count`` copies of the waiting run ``template_pk`` and its steps, their ids above every run
    so far; the seconds it took. Server-side: the columns are the ORM's (every concrete field of
    the run and the step), the values the engine's own row's, but for each copy's own workflow id,
    input, input hash (the engine's keyed hash, computed here) and idempotency keys (sha256 of
    ``workflow_id:step:vN``, as ``recovery.contract.idempotency_key``; checked after)."""
    from django.db import connection, transaction

    from recovery.contract import idempotency_key
    from recovery.engine.transitions.runs import input_hashes
    from recovery.models import StepExecution, WorkflowRun

    quote = connection.ops.quote_name
    own = {"id", "workflow_id", "input", "input_hash", "run_id", "idempotency_key"}
    run_columns = [quote(f.column) for f in WorkflowRun._meta.concrete_fields if f.attname not in own]
    step_columns = [quote(f.column) for f in StepExecution._meta.concrete_fields if f.attname not in own]
    sql = f"""
        WITH new AS (
            INSERT INTO {quote(WorkflowRun._meta.db_table)} ({", ".join(run_columns)}, workflow_id, input, input_hash)
            SELECT {", ".join(f"t.{c}" for c in run_columns)}, n.wid, jsonb_build_object('id', n.id), n.hash
            FROM {quote(WorkflowRun._meta.db_table)} AS t,
                unnest(%s::text[], %s::text[], %s::text[]) WITH ORDINALITY AS n(id, wid, hash, i)
            WHERE t.id = %s ORDER BY n.i
            RETURNING id, workflow_id
        )
        INSERT INTO {quote(StepExecution._meta.db_table)} ({", ".join(step_columns)}, run_id, idempotency_key)
        SELECT {", ".join(f"s.{c}" for c in step_columns)}, new.id,
            encode(sha256(convert_to(new.workflow_id || ':' || s.step_name || ':v' || s.key_version, 'UTF8')), 'hex')
        FROM new, {quote(StepExecution._meta.db_table)} AS s WHERE s.run_id = %s
    """
    started = time.perf_counter()
    for first in range(0, count, batch):
        ids = [f"{prefix}-{i}" for i in range(first, min(count, first + batch))]
        hashes = [input_hashes({"id": i})[0] for i in ids]
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql, [ids, [f"bench_waits:{i}" for i in ids], hashes, template_pk, template_pk])
        log(f"  {first + len(ids):,} waiting runs inserted")
    analyze()
    seconds = time.perf_counter() - started
    copy = WorkflowRun.objects.get(workflow_id=f"bench_waits:{prefix}-{count - 1}")
    if copy.input_hash != input_hashes(copy.input)[0]:
        raise BenchFailed(f"{copy.workflow_id}: its input hash is not the engine's")
    for step in StepExecution.objects.filter(run=copy):
        if step.idempotency_key != idempotency_key(copy.workflow_id, step.step_name, step.key_version):
            raise BenchFailed(f"{copy.workflow_id}: the idempotency key of {step.step_name} is not the engine's")
    return seconds


# --- the claim's plan ------------------------------------------------------------------


def _rows_read(node: dict, table: str) -> int:
    """Live rows of ``table`` a plan's scans of it read (kept, and removed by their filters), every
    loop, counted as tests/engine/test_claim_paths.py counts them: a bitmap index scan is not
    counted itself (its entries include dead rows, which its heap scan skips)."""
    read = 0
    if node.get("Relation Name") == table and "Scan" in node["Node Type"]:
        removed = node.get("Rows Removed by Filter", 0) + node.get("Rows Removed by Index Recheck", 0)
        read = (node["Actual Rows"] + removed) * node.get("Actual Loops", 1)
    return read + sum(_rows_read(child, table) for child in node.get("Plans", []))


def explain_pick(*, generic: bool, text: bool = False) -> Any:
    """EXPLAIN (ANALYZE, BUFFERS) of the claim's pick, as this process's claim runs it, rolled back."""
    from django.db import connection, transaction

    from recovery import clock, registry
    from recovery.engine.transitions.leases import _PICKED, _pick_params, _pick_sql

    sql, params = _pick_sql(connection.vendor, False, registry.deployed(), _PICKED)
    args = _pick_params(params, clock.now(), None, "bench-explain")
    options = f"ANALYZE, BUFFERS, FORMAT {'TEXT' if text else 'JSON'}"
    with transaction.atomic(), connection.cursor() as cursor:
        if generic:
            numbered = sql
            for n in range(1, len(args) + 1):
                numbered = numbered.replace("%s", f"${n}", 1)
            cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            cursor.execute(f"PREPARE bench_pick AS {numbered}")
            try:
                placeholders = ", ".join(["%s"] * len(args))
                cursor.execute(f"EXPLAIN ({options}) EXECUTE bench_pick({placeholders})", args)
                rows = cursor.fetchall()
            finally:
                cursor.execute("DEALLOCATE bench_pick")
        else:
            cursor.execute(f"EXPLAIN ({options}) {sql}", args)
            rows = cursor.fetchall()
        transaction.set_rollback(True)  # the row it locked, if any, is let go
    if text:
        return "\n".join(row[0] for row in rows)
    plan = rows[0][0]
    return json.loads(plan) if isinstance(plan, str) else plan


def claim_plan(label: str) -> dict[str, Any]:
    """Rows read, buffers and time of the pick, custom and generic plans."""
    from recovery.models import WorkflowRun

    out: dict[str, Any] = {}
    for kind in ("custom", "generic"):
        explained = explain_pick(generic=kind == "generic")[0]
        root = explained["Plan"]
        out[f"{label}_{kind}_rows_read"] = _rows_read(root, WorkflowRun._meta.db_table)
        out[f"{label}_{kind}_buffers"] = root.get("Shared Hit Blocks", 0) + root.get("Shared Read Blocks", 0)
        out[f"{label}_{kind}_ms"] = round(explained["Execution Time"], 3)
        out[f"{label}_{kind}_picked"] = root["Actual Rows"]
    return out


# --- the measurements ------------------------------------------------------------------


def idle(seconds: float, poll: float) -> dict[str, Any]:
    from recovery.engine.loop import run_forever

    deadline = time.monotonic() + seconds
    counter, wall = counted(lambda: run_forever(poll_seconds=poll, should_stop=lambda: time.monotonic() > deadline))
    polls = max(1, len(counter.claims))
    return {
        "idle_polls": len(counter.claims),
        "idle_queries_per_poll": round(counter.count / polls, 2),
        "idle_queries_per_s": round(counter.count / wall, 1),
        "idle_claim_ms": round(statistics.median(counter.claims) * 1000, 3) if counter.claims else None,
        "idle_db_ms_per_poll": round(counter.seconds * 1000 / polls, 3),
    }


def deliver(client: Any, token: str, workflow_ids: list[str], tag: str) -> None:
    for wid in workflow_ids:
        body = {"event": "go", "key": f"{tag}:{wid}", "payload": {}}
        answer = client.post(
            f"/api/runs/{wid}/events",
            data=json.dumps(body),
            content_type="application/json",
            headers={"Authorization": f"Bearer {token}"},
        )
        if answer.status_code != 201:
            raise BenchFailed(f"event for {wid}: {answer.status_code} {answer.content[:300]!r}")


def per_run(counter: Counter, wall: float, runs: int, name: str) -> dict[str, Any]:
    return {
        f"{name}_runs_per_s": round(runs / wall, 1),
        f"{name}_queries_per_run": round(counter.count / runs, 2),
        f"{name}_claim_ms": round(statistics.mean(counter.claims) * 1000, 3) if counter.claims else None,
    }


def plain_drain(figures: dict[str, Any], runs: int, size: int) -> None:
    tag = f"W={size:,}"
    log(f"{tag}: {runs:,} plain runs drained")
    plain = start_runs("bench_plain", f"p{size}", runs)
    figures.update(claim_plan("due_claim"))
    counter, wall = counted(drain)
    require(plain, "completed", f"{tag}: plain runs")
    figures.update(per_run(counter, wall, runs, "plain"))


def events(figures: dict[str, Any], client: Any, token: str, waits: list[str], tag: str) -> None:
    log(f"{tag}: {len(waits):,} events delivered, their runs completed")
    counter, wall = counted(lambda: deliver(client, token, waits, tag))
    figures["events_per_s"] = round(len(waits) / wall, 1)
    figures["event_queries"] = round(counter.count / len(waits), 2)
    figures.update(claim_plan("event_claim"))
    counter, wall = counted(drain)
    require(waits, "completed", f"{tag}: runs after their event")
    figures.update(per_run(counter, wall, len(waits), "completed"))
    figures["complete_vs_events"] = round(figures["completed_runs_per_s"] / figures["events_per_s"], 2)


def measure_none(args: argparse.Namespace, client: Any, token: str) -> tuple[dict[str, Any], list[str]]:
    """W = 0; and the M runs of the big size's events, driven to their wait with this size's."""
    figures: dict[str, Any] = {"waiting": 0}
    log(f"W=0: idle executor for {args.idle_seconds} s")
    figures.update(idle(args.idle_seconds, args.poll))
    figures.update(claim_plan("idle_claim"))
    plain_drain(figures, args.runs, 0)
    log(f"W=0: {2 * args.runs:,} runs driven to their wait (this size's events and the big size's)")
    now, later = start_runs("bench_waits", "e0", args.runs), start_runs("bench_waits", "eW", args.runs)
    counter, wall = counted(drain)
    require(now + later, "waiting", "W=0: runs driven to their wait")
    figures.update(per_run(counter, wall, 2 * args.runs, "to_wait"))
    events(figures, client, token, now, "W=0")
    return figures, later


def measure_waiting(args: argparse.Namespace, client: Any, token: str, later: list[str]) -> dict[str, Any]:
    """W = --waiting: the M runs driven to their wait before, and W - M copies of one of them."""
    from recovery.models import RunState, WorkflowRun

    size = args.waiting
    figures: dict[str, Any] = {"waiting": size}
    log(f"W={size:,}: inserting {size - args.runs:,} copies of a waiting run")
    template_pk = WorkflowRun.objects.get(workflow_id=later[0]).pk
    figures["insert_seconds"] = round(insert_waiting(size - args.runs, "w", template_pk, args.batch), 1)
    waiting = WorkflowRun.objects.filter(state=RunState.WAITING).count()
    if waiting != size:
        raise BenchFailed(f"W={size:,}: {waiting:,} runs are waiting")
    log(f"W={size:,}: idle executor for {args.idle_seconds} s")
    figures.update(idle(args.idle_seconds, args.poll))
    figures.update(claim_plan("idle_claim"))
    plans = {kind: explain_pick(generic=kind == "generic", text=True) for kind in ("custom", "generic")}
    plain_drain(figures, args.runs, size)
    events(figures, client, token, later, f"W={size:,}")
    left = WorkflowRun.objects.filter(workflow_id__startswith="bench_waits:w-", state=RunState.WAITING).count()
    if left != size - args.runs:
        raise BenchFailed(f"{size - args.runs:,} inserted runs should still be waiting, {left:,} are")
    figures["plans"] = plans
    return figures


def warm_up(client: Any, token: str) -> None:
    """A few runs of both workflows through everything measured, untimed."""
    log("warm-up: a few runs of both workflows, the event API included (untimed)")
    plain = start_runs("bench_plain", "warm", WARM_UP)
    waits = start_runs("bench_waits", "warm", WARM_UP)
    drain()
    require(plain, "completed", "warm-up: plain runs")
    require(waits, "waiting", "warm-up: runs driven to their wait")
    deliver(client, token, waits, "warm")
    drain()
    require(waits, "completed", "warm-up: runs after their event")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from django.db import connection
    from django.test import Client

    from recovery.api.tokens import issue_token

    _, token = issue_token(name="bench-waits", workflow_name="bench_waits")
    client = Client()
    warm_up(client, token)
    none, later = measure_none(args, client, token)
    waiting = measure_waiting(args, client, token, later)
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        version = cursor.fetchone()[0]
    return {"sizes": [none, waiting], "plan_text": waiting.pop("plans"), "postgres": version}


# --- the report ------------------------------------------------------------------------

ROWS = [
    ("idle polls", "idle_polls"),
    ("idle queries/poll", "idle_queries_per_poll"),
    ("idle queries/s", "idle_queries_per_s"),
    ("idle claim ms (median)", "idle_claim_ms"),
    ("idle db ms/poll", "idle_db_ms_per_poll"),
    ("idle claim rows read (custom)", "idle_claim_custom_rows_read"),
    ("idle claim rows read (generic)", "idle_claim_generic_rows_read"),
    ("idle claim buffers (custom)", "idle_claim_custom_buffers"),
    ("idle claim buffers (generic)", "idle_claim_generic_buffers"),
    ("due claim rows read (custom)", "due_claim_custom_rows_read"),
    ("due claim rows read (generic)", "due_claim_generic_rows_read"),
    ("due claim buffers (generic)", "due_claim_generic_buffers"),
    ("plain runs/s", "plain_runs_per_s"),
    ("plain queries/run", "plain_queries_per_run"),
    ("plain claim ms (mean)", "plain_claim_ms"),
    ("to-wait runs/s (2M, at W=0)", "to_wait_runs_per_s"),
    ("to-wait queries/run", "to_wait_queries_per_run"),
    ("events/s (event API)", "events_per_s"),
    ("event queries", "event_queries"),
    ("event claim rows read (generic)", "event_claim_generic_rows_read"),
    ("completed runs/s", "completed_runs_per_s"),
    ("completed queries/run", "completed_queries_per_run"),
    ("complete/events", "complete_vs_events"),
]


PLANS = ("custom", "generic")


def ratio(big: Any, small: Any) -> float | None:
    if not isinstance(big, int | float) or not isinstance(small, int | float) or not small:
        return None
    return round(big / small, 2)


def report(result: dict[str, Any], args: argparse.Namespace, load: tuple[float, float]) -> dict[str, Any]:
    small, big = result["sizes"]
    w = big["waiting"]
    print(f"\n{'W waiting runs':<34}{0:>12,}{w:>12,}{'ratio':>9}")
    for label, key in ROWS:
        a, b = small.get(key), big.get(key)
        r = ratio(b, a)
        print(f"{label:<34}{'-' if a is None else a:>12}{'-' if b is None else b:>12}{'' if r is None else r:>9}")
    for kind in PLANS:
        print(f"\nThe claim's pick with {w:,} waiting runs and nothing due, {kind} plan:\n{result['plan_text'][kind]}")

    rows = {kind: (small[f"idle_claim_{kind}_rows_read"], big[f"idle_claim_{kind}_rows_read"]) for kind in PLANS}
    walks = {kind: b - a for kind, (a, b) in rows.items() if b - a > max(100, w // 100)}
    rate = ratio(big["plain_runs_per_s"], small["plain_runs_per_s"])
    print("\nSummary:")
    print(
        f"  an idle poll: {small['idle_queries_per_poll']} queries with none waiting, "
        f"{big['idle_queries_per_poll']} with {w:,}; {small['idle_db_ms_per_poll']} vs "
        f"{big['idle_db_ms_per_poll']} ms of database time a poll "
        f"(claim {small['idle_claim_ms']} vs {big['idle_claim_ms']} ms)"
    )
    print(
        f"  draining {args.runs:,} plain runs: {small['plain_runs_per_s']} runs/s with none waiting, "
        f"{big['plain_runs_per_s']} with {w:,} (ratio {rate}); {small['plain_queries_per_run']} vs "
        f"{big['plain_queries_per_run']} queries a run, claim {small['plain_claim_ms']} vs {big['plain_claim_ms']} ms"
    )
    if walks:
        said = "; ".join(f"{kind} plan {rows[kind][0]:,} -> {rows[kind][1]:,}" for kind in walks)
        print(
            f"  FINDING: the claim reads every waiting run, on each idle poll and before each new due run: rows "
            f"read idle {said}. No more queries, but each costs O(waiting runs): a per-run cost (plans above)"
        )
    else:
        print(f"  the claim reads as many rows with {w:,} waiting runs as with none (custom and generic plans)")
    print(
        f"  {args.runs:,} events at {big['events_per_s']} events/s with {w:,} waiting; the executor completed "
        f"their runs at {big['completed_runs_per_s']} runs/s (complete/events {big['complete_vs_events']}; "
        f"{small['complete_vs_events']} with none waiting); those runs were the oldest waiting, their claim read "
        f"{big['event_claim_generic_rows_read']} row(s)"
    )
    summary = {
        "waiting": w,
        "runs": args.runs,
        "w0": small,
        "w": big,
        "ratio": {key: ratio(big.get(key), small.get(key)) for _, key in ROWS},
        "claim_walks_waiting_runs": bool(walks),
        "idle_claim_rows_read": {kind: {"w0": a, "w": b} for kind, (a, b) in rows.items()},
        "postgres": result["postgres"],
        "machine": {"cores": os.cpu_count(), "load_start": load[0], "load_end": load[1]},
    }
    return summary


# --- main --------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiting", type=int, default=100_000, help="waiting runs at the big size (default 100000)")
    parser.add_argument("--runs", type=int, default=1000, help="runs drained, and events delivered, per size")
    parser.add_argument("--idle-seconds", type=float, default=2.0, help="how long the idle executor runs")
    parser.add_argument("--poll", type=float, default=0.05, help="the idle executor's poll interval (seconds)")
    parser.add_argument("--batch", type=int, default=10_000, help="waiting runs inserted per statement")
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL") or DEFAULT_ADMIN_URL)
    args = parser.parse_args()
    if args.runs < 1 or args.waiting < args.runs:
        parser.error("--runs is at least 1 and --waiting at least --runs (M of the W waiting runs get the events)")
    return args


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # the database is dropped on the way out


def main() -> None:
    args = parse_args()
    parts = urlsplit(args.database_url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise SystemExit(f"--database-url must be a PostgreSQL URL, not {parts.scheme!r}")
    signal.signal(signal.SIGTERM, _terminated)
    database = f"bench_waits_{os.getpid()}"
    admin = psycopg.connect(urlunsplit(parts._replace(path="/postgres", query="", fragment="")), autocommit=True)
    load_start = os.getloadavg()[0]
    log(f"database {database}")
    admin.execute(f'CREATE DATABASE "{database}"')
    failed = ""
    try:
        configure(urlunsplit(parts._replace(path=f"/{database}", query="", fragment="")))
        result = run(args)
    except BenchFailed as exc:
        failed = str(exc)
    finally:
        if "django" in sys.modules:
            from django.db import connections

            connections.close_all()
        admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        admin.close()
        log(f"dropped {database}")
    if failed:
        print(f"FAIL: {failed}")
        sys.exit(1)
    summary = report(result, args, (load_start, os.getloadavg()[0]))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
