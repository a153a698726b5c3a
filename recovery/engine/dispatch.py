"""How a committed change reaches the workers: with ``RECOVERY_EXECUTOR=celery``, a transition
that makes a run (or an outbox message) due queues its task once its transaction commits.

The engine does not know the tasks: ``recovery.apps`` installs the senders (``recovery.tasks``)
when Django starts. With the embedded executor, or before anything is installed, nothing is
queued; the executor's own loop finds due work in the database.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from django.conf import settings
from django.db import transaction

from recovery import clock
from recovery.models import OutboxMessage, WorkflowRun

Sender = Callable[[int], object]

_senders: dict[str, Sender] = {}


def install(*, run: Sender, message: Sender) -> None:
    """``run(pk)`` queues a run's task, ``message(pk)`` an outbox message's."""
    _senders.update(run=run, message=message)


def _on_commit(model: type[WorkflowRun] | type[OutboxMessage], kind: str, pks: list[int]) -> None:
    send = _senders.get(kind)
    if not queues() or send is None or not pks:
        return
    # Stamped in the same transaction, so the sweeper does not queue a second task for them.
    model.objects.filter(pk__in=pks).update(dispatched_at=clock.now())
    # robust: a broker that is down right now must not undo or misreport a committed change;
    # the sweeper finds it later.
    for pk in pks:
        transaction.on_commit(partial(send, pk), robust=True)


def queues() -> bool:
    """Whether a transition that makes work due queues a task for it (and stamps it, in its
    transaction): with the Celery executor, once its senders are installed."""
    return settings.RECOVERY_EXECUTOR == "celery" and bool(_senders)


def enqueue_run(run_pk: int) -> None:
    _on_commit(WorkflowRun, "run", [run_pk])


def enqueue_runs(run_pks: list[int]) -> None:
    """``enqueue_run`` for many runs (a batch start): one dispatch stamp for all, a task each."""
    _on_commit(WorkflowRun, "run", run_pks)


def enqueue_message(outbox_pk: int) -> None:
    _on_commit(OutboxMessage, "message", [outbox_pk])
