"""The worker processes of ``bench/executor.py``, one OS process each, started from the project root:

    python -m bench.executor_workers ours                    # our embedded executor (Django settings from the env)
    python -m bench.executor_workers ours_e2e --index K --workers N --workflows M   # start each run, then run it
    python -m bench.executor_workers ours_serve              # our executor serving until "stop" on stdin
    python -m bench.executor_workers dbos --dsn URL --index K --workers N --workflows M
    python -m bench.executor_workers ceiling --dsn URL --index K --workers N --workflows M
    python -m bench.executor_workers start --workflows M     # run_start of M bench runs, before any timing

Every worker speaks the same protocol on stdin/stdout, so that only the work is timed: it sets up
and connects, flushes its connection's pending statistics (``pg_stat_force_next_flush()``, so the
set-up's transactions are counted before the benchmark's snapshot, not inside it), prints
``ready``, waits for ``go`` on stdin, does its share, prints ``done <CPU seconds it used since
go>`` (an engine worker adds what its claims' version filter tested, checked against
``BENCH_VERSION_FILTER``: ``done 1.234 filter=on deployed=bench:1,…``) and only tears down after
``exit`` on stdin.
With ``BENCH_PROFILE=DIR`` in the bench's environment, an ``ours_e2e`` worker runs its timed work
under cProfile and writes ``DIR/ours_e2e.<index>.prof`` (its CPU figure then includes the profiler).
A DBOS, ceiling or ``ours_e2e`` worker takes workflows ``K, K+N, K+2N, …`` of ``0…M-1``; our
executors share the runs already started through the engine's own claim.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import select
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

STEPS = ("first", "second", "third")  # bench.executor_workflow's steps, in order
INSERT_EFFECT = "INSERT INTO bench_effect (key, run, step) VALUES (%s, %s, %s) ON CONFLICT (key) DO NOTHING"
FLUSH_STATS = "SELECT pg_stat_force_next_flush()"
DBOS_SETTLE_SECONDS = 2.5


def effect_key(workflow_id: str, step: str) -> str:
    """The engine's idempotency key (``recovery.workflow.idempotency_key`` at key version 1), so
    that every contender writes the same keys."""
    return hashlib.sha256(f"{workflow_id}:{step}:v1".encode()).hexdigest()


def say(word: str) -> None:
    print(word, flush=True)


def ready_then_wait_for_go() -> float:
    """Returns the process's CPU time at ``go``."""
    say("ready")
    if sys.stdin.readline().strip() != "go":
        sys.exit("bench worker: expected 'go' on stdin")
    return time.process_time()


def done(cpu_at_go: float, detail: Callable[[], str] | None = None) -> None:
    """Says ``done <CPU seconds since go>`` (all of the process's threads; then ``detail()``, read
    after the CPU time, for the bench's report), then waits for ``exit`` on stdin (or its end)
    before the worker tears down: its connections stay open until the bench has read their
    backends' CPU."""
    used = time.process_time() - cpu_at_go
    say(f"done {used:.3f} {detail() if detail else ''}".rstrip())
    sys.stdin.readline()


@contextlib.contextmanager
def profiled(name: str) -> Iterator[None]:
    """With ``BENCH_PROFILE=DIR``, the timed work runs under cProfile and its statistics are written to
    ``DIR/<name>.prof`` (``python -m pstats``); without it, nothing is added."""
    directory = os.environ.get("BENCH_PROFILE")
    if not directory:
        yield
        return
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        profile.dump_stats(os.path.join(directory, f"{name}.prof"))


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()


def ours() -> None:
    """The production code path of ``manage.py run_executor --until-idle --poll 0.05``."""
    setup_django()
    from django.db import connection

    from bench.executor_workflow import claim_filter
    from recovery.engine.loop import run_forever

    with connection.cursor() as cursor:
        cursor.execute(FLUSH_STATS)
    cpu = ready_then_wait_for_go()
    run_forever(until_idle=True, poll_seconds=0.05)
    done(cpu, claim_filter)
    connection.close()


def ours_e2e(ids: range) -> None:
    """End to end, as a Celery worker consumes ``start_run``: each event started and advanced at
    once with ``executor.start_and_advance`` (the run written already claimed by this process);
    then the embedded loop until idle, for anything let go of meanwhile."""
    setup_django()
    from django.db import connection

    from bench.executor_workflow import claim_filter
    from recovery.engine.executor import start_and_advance
    from recovery.engine.loop import run_forever

    with connection.cursor() as cursor:
        cursor.execute(FLUSH_STATS)
    cpu = ready_then_wait_for_go()
    with profiled(f"ours_e2e.{ids.start}"):
        for i in ids:
            start_and_advance(workflow="bench", data={"id": str(i)})
        run_forever(until_idle=True, poll_seconds=0.05)
    done(cpu, claim_filter)
    connection.close()


def ours_serve() -> None:
    """Our embedded executor as ``manage.py run_executor`` serves: due runs advanced and due
    messages delivered (``run_due``, ``publish_due``: ``run_forever``'s round), polling every 50 ms
    while nothing is due, until the bench writes ``stop`` on stdin (bench/executor.py's ours_api,
    whose runs arrive through the event API meanwhile)."""
    setup_django()
    from django.db import connection

    from bench.executor_workflow import claim_filter
    from recovery.engine.loop import run_due
    from recovery.engine.publisher import publish_due

    with connection.cursor() as cursor:
        cursor.execute(FLUSH_STATS)
    cpu = ready_then_wait_for_go()
    while True:
        if run_due() + publish_due():
            continue
        if select.select([sys.stdin], [], [], 0.05)[0]:
            break  # "stop": every run has completed
    done(cpu, claim_filter)
    connection.close()


def start(workflows: int) -> None:
    setup_django()
    from recovery.engine.transitions import run_start

    began = time.perf_counter()
    for i in range(workflows):
        run_start(workflow="bench", data={"id": str(i)})
    say(f"started {time.perf_counter() - began:.3f}")


def ceiling(dsn: str, ids: range) -> None:
    """Two commits per step and nothing else: the checkpointed intent, then the effect with the
    outcome."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(FLUSH_STATS)
        cpu = ready_then_wait_for_go()
        for i in ids:
            workflow_id = f"bench:{i}"
            for step in STEPS:
                key = effect_key(workflow_id, step)
                with conn.transaction():
                    conn.execute(
                        "INSERT INTO bench_checkpoint (key, run, step, state) VALUES (%s, %s, %s, 'running')",
                        (key, workflow_id, step),
                    )
                with conn.transaction():
                    conn.execute(INSERT_EFFECT, (key, workflow_id, step))
                    conn.execute(
                        "UPDATE bench_checkpoint SET state = 'succeeded', remote_ref = %s, updated_at = now() "
                        "WHERE key = %s",
                        (key, key),
                    )
        done(cpu)


def dbos(dsn: str, ids: range, index: int) -> None:
    """DBOS Transact's own path: a ``@DBOS.workflow`` called directly, one at a time, under its
    workflow id, its three ``@DBOS.step`` s inserting on an autocommit connection of their own."""
    from dbos import DBOS, SetWorkflowID

    effect = psycopg.connect(dsn, autocommit=True)

    def insert(workflow_id: str, step: str) -> str:
        key = effect_key(workflow_id, step)
        effect.execute(INSERT_EFFECT, (key, workflow_id, step))
        return key

    @DBOS.step()
    def first(workflow_id: str) -> str:
        return insert(workflow_id, "first")

    @DBOS.step()
    def second(workflow_id: str) -> str:
        return insert(workflow_id, "second")

    @DBOS.step()
    def third(workflow_id: str) -> str:
        return insert(workflow_id, "third")

    @DBOS.workflow()
    def bench_workflow(workflow_id: str) -> list[str]:
        return [first(workflow_id), second(workflow_id), third(workflow_id)]

    instance = DBOS(
        config={
            "name": "bench",
            "system_database_url": dsn,
            "run_migrations": False,  # the bench migrated the template database
            "executor_id": f"bench-{index}",
            "log_level": "WARNING",
        }
    )
    DBOS.launch()
    # DBOS's background threads keep some pooled connections checked out, and a busy backend
    # flushes its statistics at most once a second: let the launch's transactions on those reach
    # the counters, then flush the idle ones (DBOS exposes no public handle on its engine).
    time.sleep(DBOS_SETTLE_SECONDS)
    flush_pool_stats(instance._sys_db.engine)
    effect.execute(FLUSH_STATS)
    cpu = ready_then_wait_for_go()
    for i in ids:
        workflow_id = f"bench:{i}"
        with SetWorkflowID(workflow_id):
            bench_workflow(workflow_id)
    done(cpu)
    DBOS.destroy()
    effect.close()


def flush_pool_stats(engine: Any) -> None:
    """Flush the pending statistics of every idle connection of a SQLAlchemy pool: take them all
    out at once, run the flush on each, give them back."""
    connections = [engine.connect() for _ in range(engine.pool.checkedin())]
    for conn in connections:
        conn.exec_driver_sql(FLUSH_STATS)
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["ours", "ours_e2e", "ours_serve", "start", "dbos", "ceiling"])
    parser.add_argument("--dsn", help="the contender's database (dbos, ceiling)")
    parser.add_argument("--index", type=int, default=0, help="this worker's index, 0…N-1")
    parser.add_argument("--workers", type=int, default=1, help="N, the number of workers")
    parser.add_argument("--workflows", type=int, default=0, help="M, the number of workflows in all")
    args = parser.parse_args()
    ids = range(args.index, args.workflows, args.workers)
    match args.kind:
        case "ours":
            ours()
        case "ours_e2e":
            ours_e2e(ids)
        case "ours_serve":
            ours_serve()
        case "start":
            start(args.workflows)
        case "dbos":
            dbos(args.dsn, ids, args.index)
        case "ceiling":
            ceiling(args.dsn, ids)


if __name__ == "__main__":
    main()
