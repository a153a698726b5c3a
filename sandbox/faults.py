"""Scripted faults for the simulated systems, the clean slate, and the tracker's approvers
working through tasks (the demo's reset).

Used by the tests, the ``sandbox`` command and the HTTP views (through ``consume_fault``).
Faults live in the sandbox database, so a fault armed by one process (a test, the command)
is seen by another (the server that answers the adapters).
"""

from collections.abc import Iterable

from django.db import transaction
from django.db.models import F, Q

from .models import (
    FAULTABLE,
    Fault,
    FaultMode,
    IdempotencyRecord,
    LedgerEntry,
    LedgerKind,
    Message,
    MessageKind,
    Task,
    TaskStatus,
)

DB = "sandbox"


# (minimum, maximum) of a fault's numbers: a fault hits a test or a demo, not a year of calls,
# and a slow reply must not hold a server thread for hours (nor overflow the integer columns).
LIMITS = {"times": (1, 100_000), "retry_after": (0, 86_400), "delay_ms": (0, 600_000)}


def validate(service: str, operation: str, mode: str, *, times: int = 1, retry_after: int = 1, delay_ms: int = 0):
    """Raise ValueError (one clear line) unless this is a faultable operation and a known mode."""
    if service not in FAULTABLE:
        raise ValueError(f"unknown service {service!r} (expected one of: {', '.join(FAULTABLE)})")
    operations = FAULTABLE[service]
    if operation not in operations:
        raise ValueError(f"unknown operation {operation!r} for {service} (expected one of: {', '.join(operations)})")
    if mode not in FaultMode.values:
        raise ValueError(f"unknown mode {mode!r} (expected one of: {', '.join(FaultMode.values)})")
    for name, value in (("times", times), ("retry_after", retry_after), ("delay_ms", delay_ms)):
        minimum, maximum = LIMITS[name]
        if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
            raise ValueError(f"{name} must be an integer from {minimum} to {maximum:,}, got {value!r}")


def set_fault(service: str, operation: str, mode: str, *, times: int = 1, retry_after: int = 1, delay_ms: int = 0):
    """Arm a fault for the next ``times`` calls of (service, operation). Faults armed for the
    same operation are consumed oldest first. Invalid input raises ValueError and writes nothing."""
    validate(service, operation, mode, times=times, retry_after=retry_after, delay_ms=delay_ms)
    with transaction.atomic(using=DB):
        return Fault.objects.using(DB).create(
            service=service,
            operation=operation,
            mode=mode,
            remaining=times,
            retry_after=retry_after,
            delay_ms=delay_ms,
        )


def consume_fault(service: str, operation: str) -> Fault | None:
    """Take one unit of the oldest active fault for (service, operation), or None.

    Invariant: each unit is consumed exactly once, even across processes: the decrement is a
    conditional ``UPDATE … SET remaining = remaining - 1 WHERE pk = … AND remaining > 0``; a
    caller that loses the race for a fault's last unit looks for the next one."""
    active = Fault.objects.using(DB).filter(service=service, operation=operation, remaining__gt=0)
    while True:
        fault = active.order_by("created_at", "pk").first()
        if fault is None:
            return None
        with transaction.atomic(using=DB):
            taken = active.filter(pk=fault.pk).update(remaining=F("remaining") - 1)
        if taken:
            fault.remaining -= 1
            return fault


def clear() -> None:
    """A clean slate: removes every fault, task, idempotency record, message and ledger entry."""
    with transaction.atomic(using=DB):
        Fault.objects.using(DB).all().delete()
        IdempotencyRecord.objects.using(DB).all().delete()
        Task.objects.using(DB).all().delete()
        # Corrections and reversals PROTECT what they point at; unlink, then delete.
        Message.objects.using(DB).exclude(corrects=None).update(corrects=None)
        Message.objects.using(DB).all().delete()
        LedgerEntry.objects.using(DB).exclude(reverses=None).update(reverses=None)
        LedgerEntry.objects.using(DB).all().delete()


def finish_tasks(invoices: Iterable[tuple[str, str]]) -> int:
    """The tracker's assignees work through the open tasks of ``invoices`` ((tenant, invoice id)
    pairs, as the tasks' payloads name them): each becomes ``done``; returns how many. A done task
    is no longer open, so a search of the open tasks (a duplicate check) leaves it out, yet it is
    not cancelled: a look-up by key finds it as before, ``counts`` (of a run too) stays the same,
    and a compensation may still cancel it."""
    wanted = set(invoices)
    tenants = sorted({tenant for tenant, _ in wanted})
    open_tasks = Task.objects.using(DB).filter(status=TaskStatus.OPEN, payload__tenant__in=tenants)
    pks = [task.pk for task in open_tasks if (task.payload.get("tenant"), task.payload.get("invoice_id")) in wanted]
    # Conditional: a task cancelled meanwhile stays cancelled.
    return Task.objects.using(DB).filter(pk__in=pks, status=TaskStatus.OPEN).update(status=TaskStatus.DONE)


def counts(*, keys: Iterable[str] | None = None, reference_prefix: str | None = None) -> dict[str, int]:
    """What the simulated systems hold: the numbers a failure test asserts on. With ``keys``,
    only what carries one of them (a task's idempotency key, a message's client reference, a
    ledger entry's reference), and the ledger entries whose reference is ``reference_prefix``
    or begins with it and a colon: one run's objects, duplicates included."""
    tasks = Task.objects.using(DB)
    messages = Message.objects.using(DB)
    ledger = LedgerEntry.objects.using(DB)
    if keys is not None:
        keys = list(keys)
        tasks = tasks.filter(idempotency_key__in=keys)
        messages = messages.filter(client_ref__in=keys)
        own = Q(reference__in=keys)
        if reference_prefix:
            own |= Q(reference=reference_prefix) | Q(reference__startswith=f"{reference_prefix}:")
        ledger = ledger.filter(own)
    return {
        "tasks": tasks.count(),
        "tasks_cancelled": tasks.filter(status=TaskStatus.CANCELLED).count(),
        "messages": messages.filter(kind=MessageKind.MESSAGE).count(),
        "corrections": messages.filter(kind=MessageKind.CORRECTION).count(),
        "ledger_entries": ledger.filter(kind=LedgerKind.ENTRY).count(),
        "ledger_reversals": ledger.filter(kind=LedgerKind.REVERSAL).count(),
    }
