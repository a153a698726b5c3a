"""What the simulated systems do, independent of HTTP: each function returns a ``Reply``
(status, JSON body, headers) that the views send as is.

Every write runs in ``transaction.atomic(using="sandbox")`` and has committed when the function
returns, so a fault that "drops" the response after the write really leaves it committed, and
one that delays the write (``late_commit``) really commits only after its wait.
Uniqueness (idempotency keys, ledger references, one reversal per entry) is enforced by the
database: insert, catch IntegrityError, then read what is there; never check-then-insert.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

import httpx
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from .faults import DB, consume_fault
from .models import (
    FaultMode,
    IdempotencyRecord,
    LedgerEntry,
    LedgerKind,
    Message,
    MessageKind,
    Task,
    TaskStatus,
    parse_public_id,
)


@dataclass(frozen=True)
class Reply:
    status: int
    body: dict
    headers: dict[str, str] = field(default_factory=dict)


def error(status: int, message: str, **extra) -> Reply:
    return Reply(status, {"error": message, **extra})


def results(items) -> Reply:
    return Reply(200, {"results": [item.as_json() for item in items]})


# --- Faults ----------------------------------------------------------------------------


def past_timeout_seconds(delay_ms: int) -> float:
    """How long ``commit_then_drop`` holds its answer and ``late_commit`` holds the request:
    ``delay_ms``, or by default (0) one second past the adapters' read timeout
    (``settings.RECOVERY_HTTP_TIMEOUT``), so that the caller gives up before the answer comes
    (commit_then_drop) or before the write happens (late_commit)."""
    if delay_ms:
        return delay_ms / 1000
    return float(settings.RECOVERY_HTTP_TIMEOUT) + 1


def run_faultable(service: str, operation: str, perform: Callable[[], Reply]) -> Reply:
    """Call ``perform`` under the next scripted fault for (service, operation), if any.

    Invariant: the refusing modes (fail_before_commit, rate_limit, forbidden, unavailable) never
    call ``perform``, so nothing is written. The others call it exactly once and differ in when:

    - commit_then_drop performs at once (it has committed when ``perform`` returns), then waits
      past the caller's timeout: the effect exists, the answer is lost;
    - late_commit waits past the caller's timeout first, then performs (it commits late, after
      the caller gave up) and answers to nobody;
    - slow waits ``delay_ms``, then performs and answers; a delay below the caller's timeout is a
      slow success, above it a late commit like late_commit's.

    For a look-up (``perform`` reads, writes nothing) the same modes mean: refused (500, 429,
    403, 503), the answer comes after the caller's timeout (commit_then_drop, late_commit: a
    dropped answer), or late (slow)."""
    fault = consume_fault(service, operation)
    if fault is None:
        return perform()
    match fault.mode:
        case FaultMode.FAIL_BEFORE_COMMIT:
            return error(500, "simulated failure before commit: nothing was written")
        case FaultMode.RATE_LIMIT:
            reply = error(429, "rate limited (simulated)", retry_after=fault.retry_after)
            return Reply(reply.status, reply.body, {"Retry-After": str(fault.retry_after)})
        case FaultMode.FORBIDDEN:
            return error(403, "forbidden (simulated)")
        case FaultMode.UNAVAILABLE:
            return error(503, "service unavailable (simulated)")
        case FaultMode.SLOW:
            time.sleep(fault.delay_ms / 1000)
            return perform()
        case FaultMode.COMMIT_THEN_DROP:
            reply = perform()  # committed before it returns
            time.sleep(past_timeout_seconds(fault.delay_ms))
            return reply
        case FaultMode.LATE_COMMIT:
            time.sleep(past_timeout_seconds(fault.delay_ms))  # the caller gives up meanwhile
            return perform()  # commits now, after the caller gave up
    raise AssertionError(f"unhandled fault mode {fault.mode!r}")


# --- Tasks (honour Idempotency-Key) ----------------------------------------------------


def request_hash(document: dict) -> str:
    """A stable hash of a JSON request: key order and whitespace do not matter."""
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def create_task(*, key: str, title: str, assignee: str, payload: dict, callback_url: str = "") -> Reply:
    """Create a task under an Idempotency-Key, like Stripe.

    Invariant: one key creates at most one task, even under concurrent requests: the key is
    claimed by inserting its UNIQUE record; the loser of the race gets an IntegrityError and
    reads the winner's record. The same request replays the stored first response (with
    ``Idempotent-Replayed: true``); a different request with that key is a 422."""
    request = {"title": title, "assignee": assignee, "payload": payload}
    digest = request_hash({**request, "callback_url": callback_url} if callback_url else request)
    with transaction.atomic(using=DB):
        try:
            with transaction.atomic(using=DB):
                record = IdempotencyRecord.objects.using(DB).create(key=key, request_hash=digest)
        except IntegrityError:
            record = IdempotencyRecord.objects.using(DB).get(key=key)
            if record.request_hash != digest:
                return error(422, "idempotency key reused with a different payload")
            return Reply(record.response_status, record.response_body, {"Idempotent-Replayed": "true"})
        task = Task.objects.using(DB).create(
            title=title, assignee=assignee, payload=payload, idempotency_key=key, callback_url=callback_url
        )
        record.response_status, record.response_body = 201, task.as_json()
        record.save(using=DB, update_fields=["response_status", "response_body"])
    return Reply(record.response_status, record.response_body)


def find_tasks(
    *,
    idempotency_key: str | None = None,
    tenant: str | None = None,
    amount: Decimal | None = None,
    currency: str | None = None,
) -> Reply:
    """Tasks by idempotency key (any status: a look-up must find a cancelled task too), or a
    search of the open tasks by their payload's ``tenant``, ``amount`` and ``currency`` (each
    optional, all given must match). Payload amounts are whatever the creator sent ("1840.00",
    "1840.0", 1840): they are compared as decimals, so the same sum always matches."""
    tasks = Task.objects.using(DB).all()
    if idempotency_key is not None:
        tasks = tasks.filter(idempotency_key=idempotency_key)
    if tenant is None and amount is None and currency is None:
        return results(tasks)
    tasks = tasks.filter(status=TaskStatus.OPEN)
    if tenant is not None:
        tasks = tasks.filter(payload__tenant=tenant)
    if currency is not None:
        tasks = tasks.filter(payload__currency=currency)
    if amount is not None:
        tasks = [task for task in tasks if _decimal(task.payload.get("amount")) == amount]
    return results(tasks)


def _decimal(value) -> Decimal | None:
    """A payload's amount as a decimal, or None when it is not a number."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float, Decimal)):
        return None
    try:
        number = Decimal(str(value).strip())
    except InvalidOperation:
        return None
    return number if number.is_finite() else None


def get_object(model, public_id: str, what: str) -> Reply:
    """One object by its own id (``task_12``, ``msg_3``, ``le_7``): 404 when there is none."""
    pk = parse_public_id(model.PREFIX, public_id)
    manager = model.objects.using(DB)
    if model is LedgerEntry:
        manager = manager.select_related("reversal")
    found = manager.filter(pk=pk).first() if pk is not None else None
    if found is None:
        return error(404, f"no {what} {public_id!r}")
    return Reply(200, found.as_json())


def cancel_task(task_id: str, *, reason: str) -> Reply:
    """Cancel a task, open or done. Idempotent: a cancelled task does not change, so the first
    reason is kept."""
    pk = parse_public_id(Task.PREFIX, task_id)
    with transaction.atomic(using=DB):
        Task.objects.using(DB).filter(pk=pk).exclude(status=TaskStatus.CANCELLED).update(
            status=TaskStatus.CANCELLED, cancel_reason=reason
        )
        task = Task.objects.using(DB).filter(pk=pk).first()
    if task is None:
        return error(404, f"no task {task_id!r}")
    return Reply(200, task.as_json())


DECISIONS = {"approve": "approved", "reject": "rejected"}


def decide_task(task_id: str, *, decision: str, by: str, note: str) -> Reply:
    """The assignee approves or rejects a task. The first decision stands: the same one again
    changes nothing (and calls back again: the sender's retry, one event under one key at the
    receiver); the other one, or a decision on a cancelled task, is a 409. Then, if the task was
    created with a ``callback_url``, the tracker posts the decision there, signed (``_call_back``),
    and records how that went on the task."""
    if decision not in DECISIONS:
        return error(400, "'decision' is approve or reject")
    pk = parse_public_id(Task.PREFIX, task_id)
    with transaction.atomic(using=DB):
        task = Task.objects.using(DB).select_for_update().filter(pk=pk).first()
        if task is None:
            return error(404, f"no task {task_id!r}")
        if task.status == TaskStatus.CANCELLED:
            return error(409, f"{task.public_id} is cancelled: it cannot be decided")
        if task.decision and task.decision != DECISIONS[decision]:
            return error(409, f"{task.public_id} was {task.decision} already, by {task.decided_by}")
        if not task.decision:
            task.decision, task.decided_by, task.decision_note = DECISIONS[decision], by, note
            task.decided_at, task.status = timezone.now(), TaskStatus.DONE
            task.save(using=DB, update_fields=["decision", "decided_by", "decision_note", "decided_at", "status"])
    if task.callback_url:
        task.callback_status = _call_back(task)[:300]
        Task.objects.using(DB).filter(pk=pk).update(callback_status=task.callback_status)
    return Reply(200, task.as_json())


def watch_task(task_id: str, *, callback_url: str) -> Reply:
    """Call ``callback_url`` back when the task is decided: the task keeps it (the same one again
    changes nothing; another replaces it). A task decided already calls it back at once — the
    approver was faster than the workflow; the receiver keeps the event for its wait."""
    pk = parse_public_id(Task.PREFIX, task_id)
    with transaction.atomic(using=DB):
        task = Task.objects.using(DB).select_for_update().filter(pk=pk).first()
        if task is None:
            return error(404, f"no task {task_id!r}")
        if task.callback_url != callback_url:
            task.callback_url = callback_url
            task.save(using=DB, update_fields=["callback_url"])
    if task.decision:
        task.callback_status = _call_back(task)[:300]
        Task.objects.using(DB).filter(pk=pk).update(callback_status=task.callback_status)
    return Reply(200, task.as_json())


def _call_back(task: Task) -> str:
    """POST the task's decision to its callback URL as the event ``task_decided``, under the key
    ``tracker:<task>:decided``, signed as the engine's own webhooks are (HMAC-SHA256 of
    "timestamp.body" under SANDBOX_CALLBACK_SECRET). Returns how it went ("201", "failed: …")."""
    event = {
        "event": "task_decided",
        "key": f"tracker:{task.public_id}:decided",
        "payload": {
            "task": task.public_id,
            "decision": task.decision,
            "by": task.decided_by,
            "note": task.decision_note,
        },
    }
    body = json.dumps(event, sort_keys=True).encode()
    timestamp = str(int(time.time()))
    secret = settings.SANDBOX_CALLBACK_SECRET.encode()
    digest = hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    headers = {
        "Content-Type": "application/json",
        "X-Recovery-Sender": "tracker",
        "X-Recovery-Timestamp": timestamp,
        "X-Recovery-Signature": f"sha256={digest}",
    }
    try:
        response = httpx.post(task.callback_url, content=body, headers=headers, timeout=CALLBACK_TIMEOUT)
    except httpx.HTTPError as exc:
        return f"failed: {type(exc).__name__}: {exc}"
    if response.status_code >= 300:
        return f"failed: {response.status_code} {response.text[:200]}"
    return str(response.status_code)


CALLBACK_TIMEOUT = 10.0


# --- Messages (never dedupe) -----------------------------------------------------------


def send_message(*, to: str, text: str, client_ref: str) -> Reply:
    """Send a message. Invariant: every call is a new message; no key is honoured."""
    with transaction.atomic(using=DB):
        message = Message.objects.using(DB).create(to=to, text=text, client_ref=client_ref)
    return Reply(201, message.as_json())


def find_messages(*, client_ref: str | None) -> Reply:
    messages = Message.objects.using(DB).order_by("created_at", "pk")
    if client_ref is not None:
        messages = messages.filter(client_ref=client_ref)
    return results(messages)


def correct_message(message_id: str, *, text: str, client_ref: str) -> Reply:
    """Send a correction of a message: a new message (kind ``correction``) that points at it.
    The original is never edited."""
    pk = parse_public_id(Message.PREFIX, message_id)
    with transaction.atomic(using=DB):
        original = Message.objects.using(DB).filter(pk=pk).first()
        if original is None:
            return error(404, f"no message {message_id!r}")
        correction = Message.objects.using(DB).create(
            to=original.to, text=text, client_ref=client_ref, kind=MessageKind.CORRECTION, corrects=original
        )
    return Reply(201, correction.as_json())


# --- Ledger (unique reference, reversals only) -----------------------------------------


def post_entry(*, reference: str, amount: Decimal, currency: str, account: str, memo: str) -> Reply:
    """Post a ledger entry. Invariant: a reference is posted at most once (UNIQUE); a duplicate
    is a 409 naming the existing entry, and writes nothing."""
    try:
        with transaction.atomic(using=DB):
            entry = LedgerEntry.objects.using(DB).create(
                reference=reference, amount=amount, currency=currency, account=account, memo=memo
            )
    except IntegrityError:
        return _duplicate_reference(reference)
    return Reply(201, entry.as_json())


def find_entries(*, reference: str | None) -> Reply:
    entries = LedgerEntry.objects.using(DB).select_related("reversal")
    if reference is not None:
        entries = entries.filter(reference=reference)
    return results(entries)


def reverse_entry(entry_id: str, *, reference: str, memo: str) -> Reply:
    """Reverse an entry with a new entry of the negated amount. Invariant: nothing is deleted or
    edited; an entry is reversed at most once (``reverses`` is UNIQUE); a reversal is not
    reversible."""
    pk = parse_public_id(LedgerEntry.PREFIX, entry_id)
    entry = LedgerEntry.objects.using(DB).filter(pk=pk).first()
    if entry is None:
        return error(404, f"no ledger entry {entry_id!r}")
    if entry.kind == LedgerKind.REVERSAL:
        return error(400, f"{entry_id} is a reversal and cannot be reversed")
    try:
        with transaction.atomic(using=DB):
            reversal = LedgerEntry.objects.using(DB).create(
                reference=reference,
                amount=Decimal(0) - entry.amount,
                currency=entry.currency,
                account=entry.account,
                memo=memo,
                kind=LedgerKind.REVERSAL,
                reverses=entry,
            )
    except IntegrityError:
        existing = LedgerEntry.objects.using(DB).filter(reverses=entry).first()
        if existing is not None:
            return error(409, "already reversed", existing_id=existing.public_id)
        return _duplicate_reference(reference)
    return Reply(201, reversal.as_json())


def _duplicate_reference(reference: str) -> Reply:
    existing = LedgerEntry.objects.using(DB).filter(reference=reference).first()
    return error(409, "duplicate reference", existing_id=existing.public_id if existing else None)
