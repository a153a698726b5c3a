"""Counting receivers for engine tests, with scripted faults.

- tasks honour an idempotency key: the first result is kept and replayed; the same key
  with a different payload is refused (422).
- messages do not honour keys: every send is a new message; they can be found by the
  client reference we send.
- ledger entries need a unique reference: a duplicate is refused (409); look-up by reference.
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from collections.abc import Callable
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction

from recovery import clock
from recovery.errors import NotThisStep, PermanentError, RateLimited, TransientError, UnknownOutcome
from recovery.workflow import Outcome, payload_hash

from .models import RemoteObject

# kind -> queue of faults for the next calls: "fail_before_commit", "commit_then_drop",
# "rate_limit", "forbidden", "unavailable", "late_commit" (corrections: the request is committed
# LATE_SECONDS later on the engine's clock, after the caller gave up; ``land_late`` commits it)
FAULTS: dict[str, deque] = defaultdict(deque)
RETRY_AFTER = 7.0
LATE_SECONDS = 30.0
LATE: list[tuple[datetime, Callable[[], object]]] = []


def land_late(*, everything: bool = False) -> int:
    """Commit the late requests whose time has come (engine clock; with ``everything``, all of
    them: the receiver finishes its work whatever the caller does meanwhile). Returns how many."""
    now = clock.now()
    due = [item for item in LATE if everything or item[0] <= now]
    for item in due:
        LATE.remove(item)
        item[1]()
    return len(due)


def arm(kind: str, mode: str, times: int = 1) -> None:
    FAULTS[kind].extend([mode] * times)


# step name -> exceptions its next calls raise (the secrets workflow), and what each call got
RAISES: dict[str, deque] = defaultdict(deque)
CALLS: list[tuple[str, object]] = []
PLANTED: dict[str, str] = {}  # the test's own secrets ("ingestion", "password"), for the steps to echo


def clear() -> None:
    FAULTS.clear()
    LATE.clear()
    RAISES.clear()
    CALLS.clear()
    PLANTED.clear()


def scripted(step: str, intent: object) -> None:
    """Record the call; raise the step's next scripted exception, if any."""
    CALLS.append((step, intent))
    if RAISES[step]:
        raise RAISES[step].popleft()


def counts() -> dict[str, int]:
    """Objects created by the workflow's actions (and model calls), by kind."""
    return {
        kind: RemoteObject.objects.filter(kind=kind).count() for kind in ("task", "message", "ledger", "model_call")
    }


def compensations() -> dict[str, int]:
    """Objects created by compensations, by kind."""
    return {kind: RemoteObject.objects.filter(kind=kind).count() for kind in ("task_cancel", "correction", "reversal")}


def _before(kind: str) -> str | None:
    mode = FAULTS[kind].popleft() if FAULTS[kind] else None
    if mode == "fail_before_commit":
        raise TransientError(f"{kind}: 500 before commit")
    if mode == "unavailable":
        raise TransientError(f"{kind}: 503 service unavailable")
    if mode == "rate_limit":
        raise RateLimited(f"{kind}: 429 too many requests", retry_after=RETRY_AFTER)
    if mode == "forbidden":
        raise PermanentError(f"{kind}: 403 forbidden")
    return mode


def _after(kind: str, mode: str | None) -> None:
    if mode == "commit_then_drop":
        raise UnknownOutcome(f"{kind}: timed out after the request was sent")


def create_task(*, key: str, payload: dict) -> Outcome:
    mode = _before("task")
    try:
        with transaction.atomic():
            obj = RemoteObject.objects.create(kind="task", dedupe_key=key, payload=payload)
    except IntegrityError:
        obj = RemoteObject.objects.get(kind="task", dedupe_key=key)
        if payload_hash(obj.payload) != payload_hash(payload):
            raise PermanentError("tasks: 422 idempotency key reused with a different payload") from None
    _after("task", mode)
    return Outcome(remote_ref=f"task-{obj.pk}", result={"task_id": obj.pk})


def send_message(*, client_ref: str, payload: dict) -> Outcome:
    mode = _before("message")
    obj = RemoteObject.objects.create(kind="message", client_ref=client_ref, payload=payload)
    _after("message", mode)
    return Outcome(remote_ref=f"msg-{obj.pk}", result={"message_id": obj.pk})


def find_message(*, client_ref: str) -> Outcome | None:
    obj = RemoteObject.objects.filter(kind="message", client_ref=client_ref).order_by("pk").first()
    return Outcome(remote_ref=f"msg-{obj.pk}", result={"message_id": obj.pk}) if obj else None


def post_entry(*, reference: str, payload: dict) -> Outcome:
    mode = _before("ledger")
    try:
        with transaction.atomic():
            obj = RemoteObject.objects.create(kind="ledger", dedupe_key=reference, payload=payload)
    except IntegrityError:
        raise PermanentError(f"ledger: 409 reference {reference} already posted") from None
    _after("ledger", mode)
    return Outcome(remote_ref=f"entry-{obj.pk}", result={"entry_id": obj.pk})


def look_up_entry(*, reference: str) -> Outcome | None:
    """A guard's fresh read of the ledger: fails as armed for "ledger_read"."""
    _before("ledger_read")
    return find_entry(reference=reference)


def find_entry(*, reference: str) -> Outcome | None:
    obj = RemoteObject.objects.filter(kind="ledger", dedupe_key=reference).first()
    return Outcome(remote_ref=f"entry-{obj.pk}", result={"entry_id": obj.pk}) if obj else None


# --- an operator's evidence, checked by the receiver's own id (a step's @lookup_ref) ------

# kind -> the prefix of its remote references, and what the step's own object carries
_REFS = {"task": "task", "message": "msg", "ledger": "entry"}


def by_ref(kind: str, ref: str, *, mine: dict[str, str]) -> Outcome | None:
    """The object ``ref`` (``task-3``, ``msg-4``, ``entry-5``) as its step would record it; None
    when there is none; NotThisStep when its key or reference is not ``mine`` (``{"dedupe_key":
    …}`` or ``{"client_ref": …}``). Fails as armed for ``<kind>_get``."""
    _before(f"{kind}_get")
    prefix, _, pk = ref.partition("-")
    obj = RemoteObject.objects.filter(kind=kind, pk=int(pk)).first() if prefix == _REFS[kind] and pk.isdigit() else None
    if obj is None:
        return None
    field, value = next(iter(mine.items()))
    if getattr(obj, field) != value:
        raise NotThisStep(f"{ref} belongs to another request ({field} {getattr(obj, field)!r})")
    key = {"task": "task_id", "message": "message_id", "ledger": "entry_id"}[kind]
    return Outcome(remote_ref=ref, result={key: obj.pk})


# --- compensations: each idempotent under its own key ----------------------------------


def cancel_task(*, task_ref: str, key: str, reason: str) -> Outcome:
    mode = _before("task_cancel")
    try:
        with transaction.atomic():
            obj = RemoteObject.objects.create(
                kind="task_cancel", dedupe_key=key, payload={"task": task_ref, "reason": reason}
            )
    except IntegrityError:
        obj = RemoteObject.objects.get(kind="task_cancel", dedupe_key=key)
    _after("task_cancel", mode)
    return Outcome(remote_ref=f"cancel-{obj.pk}")


def send_correction(*, client_ref: str, corrects: str, text: str) -> Outcome:
    existing = RemoteObject.objects.filter(kind="correction", client_ref=client_ref).first()
    if existing is None:
        mode = _before("correction")

        def commit():
            return RemoteObject.objects.create(kind="correction", client_ref=client_ref, payload={"corrects": corrects})

        if mode == "late_commit":
            LATE.append((clock.now() + timedelta(seconds=LATE_SECONDS), commit))
            raise UnknownOutcome("correction: timed out; the messenger is still working on the request")
        existing = commit()
        _after("correction", mode)
    return Outcome(remote_ref=f"msg-{existing.pk}")


def reverse_entry(*, entry_ref: str, reference: str) -> Outcome:
    mode = _before("reversal")
    try:
        with transaction.atomic():
            obj = RemoteObject.objects.create(kind="reversal", dedupe_key=reference, payload={"reverses": entry_ref})
    except IntegrityError:
        obj = RemoteObject.objects.get(kind="reversal", dedupe_key=reference)
    _after("reversal", mode)
    return Outcome(remote_ref=f"reversal-{obj.pk}")


# --- a scripted model ------------------------------------------------------------------
# Outputs to return next (raw text); when empty, the model answers deterministically.
MODEL_SCRIPT: deque[str] = deque()


def model_propose(text: str) -> str:
    RemoteObject.objects.create(kind="model_call", payload={"text": text})
    if MODEL_SCRIPT:
        return MODEL_SCRIPT.popleft()
    amount = sum(int(tok) for tok in text.split() if tok.isdigit())
    category = "travel" if "trip" in text else "office"
    return json.dumps({"category": category, "amount": amount, "approver": "alice"})


# --- a scripted agent model ------------------------------------------------------------
# Replies to return next (a dict or text); when empty, the model resolves the dispute: look the
# invoice up, then credit it and tell the customer (two calls in one turn), then answer.
AGENT_SCRIPT: deque[object] = deque()


def agent_reply(dispute: dict, messages: list[dict], tools: list[str]) -> object:
    RemoteObject.objects.create(kind="model_call", payload={"messages": len(messages), "tools": tools})
    if AGENT_SCRIPT:
        return AGENT_SCRIPT.popleft()
    answers = [json.loads(m["content"]) for m in messages if m["role"] == "tool"]
    asked = [c["function"]["name"] for m in messages if m["role"] == "assistant" for c in m.get("tool_calls", ())]
    found = next((a["result"] for a in answers if "invoice" in (a.get("result") or {})), None)
    if found is None:
        return tool_calls(("find_invoice", {"invoice": dispute["invoice"]}))
    if "notify_customer" not in asked:
        return tool_calls(
            ("credit", {"invoice": found["invoice"], "amount": found["amount"]}),
            ("notify_customer", {"text": f"credited {found['amount']} on {found['invoice']}"}),
        )
    refused = any("error" in answer for answer in answers)
    return json.dumps({"resolution": "refused" if refused else "credited", "amount": dispute["amount"]})


def tool_calls(*calls: tuple[str, object]) -> dict:
    """An OpenAI-style assistant message asking for ``calls`` (name, arguments)."""
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call-{name}-{index}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
            for index, (name, args) in enumerate(calls)
        ],
    }


def sandbox_task(*, key: str, body: dict) -> Outcome:
    """A task in the simulated tracker, over HTTP (settings.SANDBOX_URL: a live server in the test),
    under the step's key; the tracker keeps ``callback_url`` to call the run back when decided."""
    import httpx
    from django.conf import settings

    headers = {"Idempotency-Key": key, "Authorization": f"Bearer {settings.SANDBOX_API_KEY}"}
    try:
        response = httpx.post(f"{settings.SANDBOX_URL}/sandbox/tasks/", json=body, headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise UnknownOutcome(f"tracker: {exc}") from None
    if response.status_code >= 400:
        raise PermanentError(f"tracker: {response.status_code} {response.text[:200]}")
    task = response.json()
    return Outcome(remote_ref=task["id"], result={"task": task["id"]})


def decide_in_tracker(task: str, decision: str, *, by: str = "alice", note: str = ""):
    """The assignee approves or rejects ``task`` in the simulated tracker, over HTTP
    (settings.SANDBOX_URL): the tracker then calls back the run that asked it to."""
    import httpx
    from django.conf import settings

    return httpx.post(
        f"{settings.SANDBOX_URL}/sandbox/tasks/{task}/decide",
        json={"decision": decision, "by": by, "note": note},
        headers={"Authorization": f"Bearer {settings.SANDBOX_API_KEY}"},
        timeout=30,
    )
