"""The Celery contender of ``bench/executor.py``: a chain of three tasks, each inserting the same row
as the durable workflows' steps do, with Celery's defaults (early acknowledgement, no result
backend): no checkpoint, nothing durable but the broker's queue.

    celery -A bench.executor_celery worker -c N      # BENCH_BROKER_URL and BENCH_EFFECT_DSN from the env
"""

from __future__ import annotations

import functools
import os

import psycopg
from celery import Celery, chain
from celery.signals import worker_process_init

from bench.executor_workers import FLUSH_STATS, INSERT_EFFECT, STEPS, effect_key

QUEUE = "bench"

app = Celery("bench_executor", broker=os.environ.get("BENCH_BROKER_URL"))
app.conf.update(task_default_queue=QUEUE, task_ignore_result=True, broker_connection_retry_on_startup=True)


@functools.cache
def effect_connection() -> psycopg.Connection:
    """One autocommit connection per pool process."""
    return psycopg.connect(os.environ["BENCH_EFFECT_DSN"], autocommit=True)


@worker_process_init.connect
def connect(**kwargs: object) -> None:
    """Connect when the pool process starts, as the other contenders' workers do before they are
    timed, and flush the connection's statistics (the bench waits for this statement)."""
    effect_connection().execute(FLUSH_STATS)


@app.task
def step(workflow_id: str, name: str) -> None:
    effect_connection().execute(INSERT_EFFECT, (effect_key(workflow_id, name), workflow_id, name))


def workflow(i: int) -> chain:
    workflow_id = f"bench:{i}"
    return chain(*(step.si(workflow_id, name) for name in STEPS))
