"""Celery interfaces: thin wrappers that take ids and call the engine.

``acks_late`` and ``reject_on_worker_lost`` are safe only because ``advance`` is idempotent
and the database lease, not the broker, decides who owns a run. Attempts and retry times
live in the database: no ``autoretry_for`` here. The one exception is the database itself:
a task that could not reach it (a restart, a failover) is retried by Celery with backoff
instead of being acknowledged and left for the sweeper's redispatch.
"""

import random

from celery import shared_task
from django.conf import settings
from django.db import InterfaceError, OperationalError, connection

from recovery.engine import executor, publisher, transitions
from recovery.errors import DatabaseUnavailable
from recovery.models import ExecutorMode
from recovery.observability import alerts

DB_RETRIES = 8  # 1, 2, 4 … 60 s: about five minutes of outage; after that, the sweeper


def database_backoff(retries: int) -> float:
    """Seconds before the next try of a task that could not reach the database: exponential
    from 1 s, at most 60 s, with jitter so that a fleet of workers does not come back at once."""
    return min(60.0, 2.0**retries) * random.uniform(0.5, 1.0)


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True, max_retries=DB_RETRIES)
def start_run(self, workflow_name: str, event: dict) -> str:
    """Consume a business event from the queue and run it here at once: the run is written
    already claimed by this worker (``executor.start_and_advance``), so no ``advance_run`` task
    and no claim follow. Redelivery (or a duplicate event) gives the same run, not advanced
    again here: the unique workflow id decides, and the lease owns the run. Returns the
    workflow id. An event that arrives while the database is out of reach is tried again,
    never dropped; a run whose advance lost the database is taken over when its lease expires
    (the sweeper queues it)."""
    try:
        run, _ = executor.start_and_advance(workflow=workflow_name, data=event)
    except (DatabaseUnavailable, OperationalError, InterfaceError) as exc:
        connection.close()
        raise self.retry(exc=exc, countdown=database_backoff(self.request.retries)) from exc
    return run.workflow_id


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True, max_retries=DB_RETRIES)
def advance_run(self, run_pk: int) -> None:
    try:
        executor.advance(run_pk)
    except DatabaseUnavailable as exc:
        # The lease this executor could not give back holds the run until it expires: not before.
        countdown = max(database_backoff(self.request.retries), settings.RECOVERY_LEASE_SECONDS)
        raise self.retry(exc=exc, countdown=countdown) from exc


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True, max_retries=DB_RETRIES)
def publish_outbox(self, outbox_pk: int) -> None:
    try:
        publisher.publish(outbox_pk)
    except DatabaseUnavailable as exc:
        countdown = max(database_backoff(self.request.retries), settings.RECOVERY_LEASE_SECONDS)
        raise self.retry(exc=exc, countdown=countdown) from exc


@shared_task(ignore_result=True)
def sweep(limit: int = 500) -> int:
    """Queue a task for each run whose retry time came or whose lease expired, and for each
    outbox message due for delivery, unless one is already queued (``dispatched_at``): a lost
    broker message delays work but never loses it; a duplicated one is refused by the lease
    (or the outbox claim). It also raises, resolves and sends the alerts on stuck runs, and
    records the worker that ran it as a live executor (``Executor``, mode celery)."""
    transitions.sweeper_beat(name="celery beat")
    transitions.executor_beat(mode=ExecutorMode.CELERY)  # this worker, in the record of live executors
    alerts.sweep()
    run_pks = transitions.runs_dispatch(limit=limit)
    for run_pk in run_pks:
        advance_run.delay(run_pk)
    outbox_pks = transitions.outbox_dispatch(limit=limit)
    for outbox_pk in outbox_pks:
        publish_outbox.delay(outbox_pk)
    return len(run_pks) + len(outbox_pks)
