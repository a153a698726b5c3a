"""HTTP JSON endpoints of the simulated systems. They stand in for Jira, Slack and an ERP that
the adapters call over real HTTP, and like those they ask the caller for its own credential
(``Authorization: Bearer <SANDBOX_API_KEY>``), not for a console session: no cookies, no CSRF.
Without the key a request is refused with 401 and changes nothing (an outsider could otherwise
create the task a run's predictable idempotency key will find, or forge ledger entries).
Views only parse and validate the request; what happens is in ``sandbox/services.py``. Every
operation, look-ups (GET) and compensations (cancel, correction, reversal) included, runs under
``services.run_faultable``: a malformed request is a 400 before any fault is consumed."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from functools import wraps

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from . import services
from .models import LedgerEntry, Message, Task
from .services import Reply


class BadRequest(Exception):
    """The request is malformed: a 400 with this message."""


def authorised(request: HttpRequest) -> bool:
    """True if the request carries the sandbox's API key. No key configured: nobody is."""
    key = settings.SANDBOX_API_KEY
    presented = request.headers.get("Authorization", "")
    return bool(key) and hmac.compare_digest(presented.encode(), f"Bearer {key}".encode())


def json_endpoint(*methods: str) -> Callable:
    """A CSRF-exempt view that answers only ``methods`` (405), only to a caller with the API key
    (401), turns BadRequest into a 400 and a ``Reply`` into a JSON response."""

    def decorate(view: Callable[..., Reply]) -> Callable:
        @csrf_exempt
        @wraps(view)
        def wrapper(request: HttpRequest, *args, **kwargs) -> JsonResponse:
            if request.method not in methods:
                response = JsonResponse({"error": f"method {request.method} not allowed"}, status=405)
                response["Allow"] = ", ".join(methods)
                return response
            if not authorised(request):
                message = "an Authorization: Bearer <SANDBOX_API_KEY> header is required"
                response = JsonResponse({"error": message}, status=401)
                response["WWW-Authenticate"] = 'Bearer realm="sandbox"'
                return response
            try:
                reply = view(request, *args, **kwargs)
            except BadRequest as exc:
                reply = services.error(400, str(exc))
            response = JsonResponse(reply.body, status=reply.status)
            for name, value in reply.headers.items():
                response[name] = value
            return response

        return wrapper

    return decorate


# --- Request parsing -------------------------------------------------------------------


def body_object(request: HttpRequest) -> dict:
    try:
        body = json.loads(request.body or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"invalid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def required_str(body: dict, name: str) -> str:
    value = body.get(name)
    if value is None:
        raise BadRequest(f"missing field {name!r}")
    if not isinstance(value, str) or not value.strip():
        raise BadRequest(f"{name!r} must be a non-empty string")
    return value


def optional_str(body: dict, name: str) -> str:
    value = body.get(name, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BadRequest(f"{name!r} must be a string")
    return value


def amount_field(body: dict) -> Decimal:
    raw = required_str(body, "amount")
    try:
        amount = Decimal(raw.strip())
    except InvalidOperation:
        raise BadRequest(f"'amount' must be a decimal string such as \"123.45\", got {raw!r}") from None
    if not amount.is_finite() or amount.as_tuple().exponent < -2:
        raise BadRequest(f"'amount' must be a finite decimal with at most 2 decimal places, got {raw!r}")
    if abs(amount) >= Decimal(10) ** 16:
        raise BadRequest("'amount' is too large")
    return amount.quantize(Decimal("0.01"))


def currency_field(body: dict) -> str:
    currency = required_str(body, "currency")
    if len(currency) != 3 or not (currency.isascii() and currency.isalpha() and currency.isupper()):
        raise BadRequest(f"'currency' must be a three-letter code such as \"EUR\", got {currency!r}")
    return currency


# --- Tasks -----------------------------------------------------------------------------


def task_search(query) -> dict:
    """``GET /sandbox/tasks/``'s filters: ``idempotency_key``, and the payload's ``tenant``,
    ``amount`` (a decimal string, compared as a sum: "1840" finds "1840.00") and ``currency``,
    which search the open tasks only (``services.find_tasks``)."""
    search: dict = {"idempotency_key": query.get("idempotency_key")}
    if "tenant" in query:
        search["tenant"] = required_str(query, "tenant")
    if "amount" in query:
        search["amount"] = amount_field(query)
    if "currency" in query:
        search["currency"] = currency_field(query)
    return search


@json_endpoint("GET", "POST")
def tasks(request: HttpRequest) -> Reply:
    if request.method == "GET":
        search = task_search(request.GET)
        return services.run_faultable("tasks", "find", lambda: services.find_tasks(**search))
    key = request.headers.get("Idempotency-Key", "").strip()
    if not key:
        raise BadRequest("missing Idempotency-Key header")
    if len(key) > 255:
        raise BadRequest("Idempotency-Key is longer than 255 characters")
    body = body_object(request)
    title, assignee = required_str(body, "title"), required_str(body, "assignee")
    payload = body.get("payload", {})
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        raise BadRequest("'payload' must be a JSON object")
    callback_url = optional_str(body, "callback_url")
    if callback_url and not callback_url.startswith(("http://", "https://")):
        raise BadRequest("'callback_url' is an http(s) URL")
    return services.run_faultable(
        "tasks",
        "create",
        lambda: services.create_task(
            key=key, title=title, assignee=assignee, payload=payload, callback_url=callback_url
        ),
    )


@json_endpoint("GET")
def task(request: HttpRequest, task_id: str) -> Reply:
    return services.run_faultable("tasks", "get", lambda: services.get_object(Task, task_id, "task"))


@json_endpoint("POST")
def task_cancel(request: HttpRequest, task_id: str) -> Reply:
    reason = required_str(body_object(request), "reason")
    return services.run_faultable("tasks", "cancel", lambda: services.cancel_task(task_id, reason=reason))


@json_endpoint("POST")
def task_decide(request: HttpRequest, task_id: str) -> Reply:
    """The assignee's approve or reject (``{"decision": "approve", "by": "alice", "note": …}``);
    the tracker then calls the task's ``callback_url`` back, signed (services.decide_task)."""
    body = body_object(request)
    decision, by, note = required_str(body, "decision"), required_str(body, "by"), optional_str(body, "note")
    return services.decide_task(task_id, decision=decision, by=by, note=note)


@json_endpoint("POST")
def task_watch(request: HttpRequest, task_id: str) -> Reply:
    """Call ``{"callback_url": …}`` back when the task is decided (at once if it is already)."""
    callback_url = required_str(body_object(request), "callback_url")
    if not callback_url.startswith(("http://", "https://")):
        raise BadRequest("'callback_url' is an http(s) URL")
    return services.watch_task(task_id, callback_url=callback_url)


# --- Messages --------------------------------------------------------------------------


@json_endpoint("GET", "POST")
def messages(request: HttpRequest) -> Reply:
    if request.method == "GET":
        ref = request.GET.get("client_ref")
        return services.run_faultable("messages", "find", lambda: services.find_messages(client_ref=ref))
    body = body_object(request)  # an Idempotency-Key header, if any, is ignored
    to, text, client_ref = required_str(body, "to"), required_str(body, "text"), optional_str(body, "client_ref")
    return services.run_faultable(
        "messages", "send", lambda: services.send_message(to=to, text=text, client_ref=client_ref)
    )


@json_endpoint("GET")
def message(request: HttpRequest, message_id: str) -> Reply:
    return services.run_faultable("messages", "get", lambda: services.get_object(Message, message_id, "message"))


@json_endpoint("POST")
def message_corrections(request: HttpRequest, message_id: str) -> Reply:
    body = body_object(request)
    text, client_ref = required_str(body, "text"), optional_str(body, "client_ref")
    return services.run_faultable(
        "messages", "correct", lambda: services.correct_message(message_id, text=text, client_ref=client_ref)
    )


# --- Ledger ----------------------------------------------------------------------------


@json_endpoint("GET", "POST")
def ledger_entries(request: HttpRequest) -> Reply:
    if request.method == "GET":
        reference = request.GET.get("reference")
        return services.run_faultable("ledger", "find", lambda: services.find_entries(reference=reference))
    body = body_object(request)
    fields = {
        "reference": required_str(body, "reference"),
        "amount": amount_field(body),
        "currency": currency_field(body),
        "account": required_str(body, "account"),
        "memo": optional_str(body, "memo"),
    }
    return services.run_faultable("ledger", "post", lambda: services.post_entry(**fields))


@json_endpoint("GET")
def ledger_entry(request: HttpRequest, entry_id: str) -> Reply:
    return services.run_faultable("ledger", "get", lambda: services.get_object(LedgerEntry, entry_id, "ledger entry"))


@json_endpoint("POST")
def ledger_reverse(request: HttpRequest, entry_id: str) -> Reply:
    body = body_object(request)
    reference, memo = required_str(body, "reference"), optional_str(body, "memo")
    return services.run_faultable(
        "ledger", "reverse", lambda: services.reverse_entry(entry_id, reference=reference, memo=memo)
    )
