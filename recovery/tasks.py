"""Celery interfaces: thin wrappers that take ids and call the engine.

``acks_late`` and ``reject_on_worker_lost`` are safe only because ``advance`` is idempotent
and the database lease, not the broker, decides who owns a run. Attempts and retry times
live in the database: no ``autoretry_for`` here.
"""

from celery import shared_task

from . import executor, transitions


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def start_run(workflow_name: str, event: dict) -> str:
    """Consume a business event from the queue. Redelivery (or a duplicate event) gives the
    same run: the unique workflow id decides. Returns the workflow id."""
    run, _ = transitions.run_start(workflow=workflow_name, data=event)
    return run.workflow_id


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def advance_run(run_pk: int) -> None:
    executor.advance(run_pk)


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def publish_outbox(outbox_pk: int) -> None:
    executor.publish(outbox_pk)


@shared_task(ignore_result=True)
def sweep(limit: int = 500) -> int:
    """Queue a task for each run whose retry time came or whose lease expired, and for each
    outbox message due for delivery, unless one is already queued (``dispatched_at``): a lost
    broker message delays work but never loses it; a duplicated one is refused by the lease
    (or the outbox claim)."""
    run_pks = transitions.runs_dispatch(limit=limit)
    for run_pk in run_pks:
        advance_run.delay(run_pk)
    outbox_pks = transitions.outbox_dispatch(limit=limit)
    for outbox_pk in outbox_pks:
        publish_outbox.delay(outbox_pk)
    return len(run_pks) + len(outbox_pks)
