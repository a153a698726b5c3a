"""HTTP adapters to the task service, the messenger and the ledger (the sandbox's receivers),
shared by the workflows: the invoice workflow's tasks, messages and postings, the dispute
workflow's look-ups, credit notes and messages.

Errors are classified once, here, into the engine's taxonomy:

- connection refused or a connect timeout: the request never left; nothing happened → transient;
- a timeout or a broken connection after the request was sent: it may have happened → unknown
  (for a read, which changes nothing, → transient);
- 429 → rate limited (Retry-After honoured); 401/403 → permanent (authorisation);
  400/404/409/422 → permanent (bad input, conflict); 5xx → transient.

Each writing operation has its look-up (by key, by client reference, by transaction
reference) so that an unknown outcome can be reconciled instead of retried blindly.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any
from urllib.parse import quote

import httpx
from django.conf import settings

from recovery.errors import (
    NotThisStep,
    PermanentError,
    RateLimited,
    StepError,
    TransientError,
    UnclassifiedError,
    UnknownOutcome,
)
from recovery.redaction import redact_text
from recovery.workflow import Outcome

RETRYABLE_STATUSES = frozenset({500, 502, 503, 504})
PERMANENT_STATUSES = frozenset({400, 401, 403, 404, 405, 409, 410, 422})


def classify_http_status(response: httpx.Response, what: str) -> StepError:
    """The engine error for a non-success response."""
    detail = _error_detail(response)
    message = f"{what}: HTTP {response.status_code} {detail}".strip()
    if response.status_code == 429:
        return RateLimited(message, retry_after=_retry_after(response))
    if response.status_code in RETRYABLE_STATUSES:
        return TransientError(message)
    if response.status_code in PERMANENT_STATUSES:
        return PermanentError(message)
    return UnclassifiedError(message)


def classify_transport_error(exc: httpx.TransportError, what: str, *, changes_state: bool) -> StepError:
    """The engine error for a request that got no response."""
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
        return TransientError(f"{what}: could not connect ({type(exc).__name__}); the request was not sent")
    if changes_state:
        return UnknownOutcome(f"{what}: no response after the request was sent ({type(exc).__name__})")
    return TransientError(f"{what}: no response ({type(exc).__name__})")


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["Retry-After"])
    except (KeyError, ValueError):
        return None


def _error_detail(response: httpx.Response) -> str:
    """The start of the receiver's error message, redacted before it is cut (a cut secret
    would no longer be recognised)."""
    try:
        body = response.json()
    except ValueError:
        return redact_text(response.text)[:200]
    return redact_text(str(body.get("error", body)) if isinstance(body, dict) else str(body))[:200]


class SandboxClient:
    """A small JSON client with explicit timeouts. ``changes_state`` tells the classifier
    whether a lost response means "unknown" (a write) or merely "try again" (a read)."""

    def __init__(
        self, *, base_url: str | None = None, timeout: float | None = None, transport=None, api_key: str | None = None
    ):
        self.base_url = (base_url or settings.SANDBOX_URL).rstrip("/")
        key = settings.SANDBOX_API_KEY if api_key is None else api_key
        # The systems' own credential (a tracker's API token), never a console session.
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}
        read = settings.RECOVERY_HTTP_TIMEOUT if timeout is None else timeout
        self.timeout = httpx.Timeout(read, connect=min(read, 5.0))
        self.transport = transport

    def request(
        self,
        method: str,
        path: str,
        *,
        what: str,
        changes_state: bool,
        json: Any = None,
        params: dict | None = None,
        headers: dict | None = None,
        accept: frozenset[int] = frozenset(),
    ) -> httpx.Response:
        try:
            with httpx.Client(base_url=self.base_url, timeout=self.timeout, transport=self.transport) as client:
                headers = {**self.auth, **(headers or {})}
                response = client.request(method, path, json=json, params=params, headers=headers)
        except httpx.TransportError as exc:
            raise classify_transport_error(exc, what, changes_state=changes_state) from exc
        if response.is_success or response.status_code in accept:
            return response
        raise classify_http_status(response, what)


def _by_id(path: str, what: str, client: SandboxClient | None) -> dict | None:
    """One object by the receiver's own id (a read), or None when the receiver has none (404)."""
    response = (client or SandboxClient()).request("GET", path, what=what, changes_state=False, accept=frozenset({404}))
    return None if response.status_code == 404 else response.json()


def own(found: dict | None, **expected: str) -> dict | None:
    """An object an operator named by its id (an ``@lookup_ref``), if it is the step's own: each
    field in ``expected`` (its key, client reference, transaction reference, kind) holds the
    step's value. None stays None (the receiver has no such object); another request's object is
    NotThisStep, naming the field that tells them apart."""
    for field, value in expected.items():
        if found is not None and found.get(field) != value:
            raise NotThisStep(
                f"{found.get('id')} was made by another request (its {field} is {found.get(field)!r}, not this step's)"
            )
    return found


def _first(response: httpx.Response) -> dict | None:
    results = response.json().get("results") or []
    return results[0] if results else None


# --- task service: honours Idempotency-Key ----------------------------------------------


def _task_outcome(task: dict) -> Outcome:
    return Outcome(remote_ref=task["id"], result={"task_id": task["id"], "status": task.get("status", "")})


def create_task(*, key: str, title: str, assignee: str, payload: dict, client: SandboxClient | None = None) -> Outcome:
    response = (client or SandboxClient()).request(
        "POST",
        "/sandbox/tasks/",
        what="create approval task",
        changes_state=True,
        json={"title": title, "assignee": assignee, "payload": payload},
        headers={"Idempotency-Key": key},
    )
    return _task_outcome(response.json())


def find_task(*, key: str, client: SandboxClient | None = None) -> Outcome | None:
    response = (client or SandboxClient()).request(
        "GET", "/sandbox/tasks/", what="look up task by key", changes_state=False, params={"idempotency_key": key}
    )
    task = _first(response)
    return _task_outcome(task) if task else None


def get_task(*, task_id: str, client: SandboxClient | None = None) -> dict | None:
    """The task ``task_id`` as the tracker shows it (its idempotency key included), or None."""
    return _by_id(f"/sandbox/tasks/{quote(task_id, safe='')}", "get task", client)


def watch_task(*, task_id: str, callback_url: str, client: SandboxClient | None = None) -> Outcome:
    """Ask the tracker to call ``callback_url`` back when task ``task_id`` is decided (at once if it
    is already). Idempotent: the same URL again changes nothing."""
    response = (client or SandboxClient()).request(
        "POST",
        f"/sandbox/tasks/{quote(task_id, safe='')}/watch",
        what="watch approval task",
        changes_state=True,
        json={"callback_url": callback_url},
    )
    task = response.json()
    return Outcome(remote_ref=task["id"], result={"task_id": task["id"], "decision": task.get("decision") or ""})


def task_outcome(task: dict) -> Outcome:
    """A task as the step records it: what ``create_task`` and ``find_task`` return."""
    return _task_outcome(task)


def find_open_tasks(
    *, tenant: str, amount: str, currency: str, client: SandboxClient | None = None
) -> list[dict[str, Any]]:
    """The tracker's open tasks whose payload has this tenant, amount and currency (a read:
    a lost answer is transient, never unknown). Each as ``{"task_id", "invoice_id"}``."""
    response = (client or SandboxClient()).request(
        "GET",
        "/sandbox/tasks/",
        what="search open tasks",
        changes_state=False,
        params={"tenant": tenant, "amount": amount, "currency": currency},
    )
    found = response.json().get("results") or []
    return [{"task_id": task["id"], "invoice_id": (task.get("payload") or {}).get("invoice_id")} for task in found]


def cancel_task(*, task_id: str, reason: str, client: SandboxClient | None = None) -> Outcome:
    """Idempotent at the receiver: cancelling a cancelled task returns it unchanged."""
    response = (client or SandboxClient()).request(
        "POST", f"/sandbox/tasks/{task_id}/cancel", what="cancel task", changes_state=True, json={"reason": reason}
    )
    task = response.json()
    return Outcome(remote_ref=task["id"], result={"task_id": task["id"], "status": task.get("status", "")})


# --- messenger: does not honour keys; found by client reference ------------------------


def _message_outcome(message: dict) -> Outcome:
    return Outcome(remote_ref=message["id"], result={"message_id": message["id"], "to": message.get("to", "")})


def send_message(*, to: str, text: str, client_ref: str, client: SandboxClient | None = None) -> Outcome:
    response = (client or SandboxClient()).request(
        "POST",
        "/sandbox/messages/",
        what="notify approver",
        changes_state=True,
        json={"to": to, "text": text, "client_ref": client_ref},
    )
    return _message_outcome(response.json())


def find_message(*, client_ref: str, client: SandboxClient | None = None) -> Outcome | None:
    response = (client or SandboxClient()).request(
        "GET", "/sandbox/messages/", what="look up message", changes_state=False, params={"client_ref": client_ref}
    )
    message = _first(response)
    return _message_outcome(message) if message else None


def get_message(*, message_id: str, client: SandboxClient | None = None) -> dict | None:
    """The message ``message_id`` as the messenger shows it (its client reference included), or None."""
    return _by_id(f"/sandbox/messages/{quote(message_id, safe='')}", "get message", client)


def message_outcome(message: dict) -> Outcome:
    return _message_outcome(message)


def send_correction(*, message_id: str, text: str, client_ref: str, client: SandboxClient | None = None) -> Outcome:
    """The messenger does not honour keys, so look for our correction before sending one
    (safe here: the run's lease admits one executor at a time)."""
    client = client or SandboxClient()
    existing = find_message(client_ref=client_ref, client=client)
    if existing is not None:
        return existing
    response = client.request(
        "POST",
        f"/sandbox/messages/{message_id}/corrections",
        what="send correction",
        changes_state=True,
        json={"text": text, "client_ref": client_ref},
    )
    return _message_outcome(response.json())


# --- ledger: unique transaction reference ------------------------------------------------


def _entry_outcome(entry: dict) -> Outcome:
    return Outcome(
        remote_ref=entry["id"],
        result={"entry_id": entry["id"], "reference": entry.get("reference", ""), "amount": entry.get("amount")},
    )


def post_entry(
    *, reference: str, amount: str, currency: str, account: str, memo: str, client: SandboxClient | None = None
) -> Outcome:
    """A duplicate reference (409) means an earlier attempt of ours was posted: return that
    entry if it is the same posting, refuse visibly if it is not."""
    client = client or SandboxClient()
    body = {"reference": reference, "amount": amount, "currency": currency, "account": account, "memo": memo}
    response = client.request(
        "POST",
        "/sandbox/ledger/entries/",
        what="post ledger entry",
        changes_state=True,
        json=body,
        accept=frozenset({409}),
    )
    if response.status_code != 409:
        return _entry_outcome(response.json())
    existing = find_entry(reference=reference, client=client)
    if existing is None:
        raise PermanentError(f"post ledger entry: 409 for {reference} but no entry found by that reference")
    same = existing.result and _same_amount(existing.result.get("amount"), amount)
    if not same:
        raise PermanentError(f"post ledger entry: reference {reference} already holds a different posting")
    return existing


def _same_amount(a: Any, b: Any) -> bool:
    try:
        return Decimal(str(a)) == Decimal(str(b))
    except InvalidOperation:
        return False


def _entry(reference: str, client: SandboxClient | None, what: str) -> dict | None:
    response = (client or SandboxClient()).request(
        "GET", "/sandbox/ledger/entries/", what=what, changes_state=False, params={"reference": reference}
    )
    return _first(response)


def ledger_entry(*, reference: str, client: SandboxClient | None = None) -> dict | None:
    """The ledger's entry for ``reference`` as the ledger shows it (amount, currency, account,
    reversal), or None: a fresh read each time."""
    return _entry(reference, client, "read ledger entry")


def get_entry(*, entry_id: str, client: SandboxClient | None = None) -> dict | None:
    """The ledger entry ``entry_id`` as the ledger shows it (its reference included), or None."""
    return _by_id(f"/sandbox/ledger/entries/{quote(entry_id, safe='')}", "get ledger entry", client)


def entry_outcome(entry: dict) -> Outcome:
    return _entry_outcome(entry)


def find_entry(*, reference: str, client: SandboxClient | None = None) -> Outcome | None:
    entry = _entry(reference, client, "look up ledger entry")
    return _entry_outcome(entry) if entry else None


def ledger_state(*, reference: str, client: SandboxClient | None = None) -> str:
    """What the ledger holds for ``reference`` now: "" (nothing), or a sentence: posted as
    which entry, or cancelled (that entry reversed). A fresh read each time."""
    entry = _entry(reference, client, "read ledger state")
    if not entry:
        return ""
    if entry.get("reversed_by"):
        return f"cancelled: {entry['id']} was reversed by {entry['reversed_by']}"
    return f"already posted as {entry['id']}"


def reverse_entry(*, entry_id: str, reference: str, memo: str, client: SandboxClient | None = None) -> Outcome:
    """Post the reversing entry (never delete). Already reversed (409) → that reversal."""
    response = (client or SandboxClient()).request(
        "POST",
        f"/sandbox/ledger/entries/{entry_id}/reverse",
        what="reverse ledger entry",
        changes_state=True,
        json={"reference": reference, "memo": memo},
        accept=frozenset({409}),
    )
    body = response.json()
    if response.status_code == 409:
        if not body.get("existing_id"):
            raise PermanentError(f"reverse ledger entry: HTTP 409 {body.get('error', '')}")
        return Outcome(remote_ref=body["existing_id"], result={"reversal_id": body["existing_id"]})
    return Outcome(remote_ref=body["id"], result={"reversal_id": body["id"], "amount": body.get("amount")})
