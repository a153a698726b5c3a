"""Events for runs that wait (issue 38): the system that sends a workflow's business events — a
token that may start its runs — delivers the event a run's durable wait waits for (an approval,
a payment's confirmation), under its own idempotency key, through ``run_deliver_event``: the
same transition as ``manage.py send_event``, audited as ``api:<token name>``.

    POST /api/runs/<workflow id>/events
    Authorization: Bearer rc_…
    {"event": "approved", "key": "tracker:17:approved", "payload": {"approved": true, "amount": 120, "by": "alice"}}

    201 {"workflow_id": …, "event": "approved", "key": "tracker:17:approved", "late": false,
         "received_at": …, "step": "approval", "duplicate": false}
    200 the same, "duplicate": true — the same key again with the same payload (nothing new)

The key may come from an ``Idempotency-Key`` header instead (both given: they must agree);
``payload`` is optional (``{}``). ``late``: the event came after its wait ended (its deadline
passed, or another event ended it): recorded, never applied. ``step``: the wait step it was for
("" for one that came before its wait was reached: used when it is).

A system that cannot hold a token signs the request instead, as our alert webhook is signed
(the tracker's callback when a task is decided): ``X-Recovery-Sender: tracker``,
``X-Recovery-Timestamp`` (Unix seconds, within 5 minutes of now) and ``X-Recovery-Signature:
sha256=`` the HMAC-SHA256 of "timestamp.body" under RECOVERY_EVENT_SIGNING_SECRET; audited as
``signed:<sender>``. A signed sender may send events to any run.

Errors are ``{"error": …}`` and write nothing: 401 no or an unknown or revoked token (or a
signature that does not match, a stale timestamp), 404 an
unknown run, 403 a token for another workflow, 400 a body that is not a JSON object (or has
unknown fields), no event or key, the two keys differing, an event the run's workflow waits for
nowhere or a payload its wait refuses, 409 a finished run or a key used for another payload
already, 413 a body over 256 KiB, 503 (with Retry-After) the database out of reach: send it
again, 405 any method but POST. Token auth, no cookies: no CSRF."""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from recovery.api import tokens
from recovery.api.views import ApiError, _token, object_body, unavailable
from recovery.engine.transitions import run_deliver_event
from recovery.errors import EventConflict, InvalidTransition
from recovery.models import RunEvent, WorkflowRun

log = logging.getLogger("recovery.api")

FIELDS = frozenset({"event", "key", "payload"})


@csrf_exempt
def deliver(request: HttpRequest, workflow_id: str) -> JsonResponse:
    try:
        if request.method != "POST":
            raise ApiError(405, f"method {request.method} not allowed; POST the event", headers={"Allow": "POST"})
        signed = _signed_by(request)
        token = None if signed else _token(request)
        run = WorkflowRun.objects.filter(workflow_id=workflow_id).only("workflow_name").first()
        if run is None:
            raise ApiError(404, f"no run {workflow_id!r}")
        if token is not None and not tokens.may_start(token, run.workflow_name):
            raise ApiError(403, f"this token may not send events to {run.workflow_name!r} runs")
        sender = f"signed:{signed}" if signed else f"api:{token.name}"
        body = _body(request)
        key = _key(request, body)
        try:
            event, new = run_deliver_event(
                workflow_id=workflow_id,
                event=body["event"],
                key=key,
                payload=body.get("payload", {}),
                actor=sender,
            )
        except WorkflowRun.DoesNotExist:
            raise ApiError(404, f"no run {workflow_id!r}") from None
        except EventConflict as exc:
            raise ApiError(409, str(exc)) from None
        except InvalidTransition as exc:  # EventRefused: not waited for, refused by its schema, no key
            raise ApiError(400, str(exc)) from None
    except ApiError as exc:
        return exc.response()
    except (OperationalError, InterfaceError) as exc:  # sent again, the same key is one event
        return unavailable(exc, "run event API")
    log.info("event %r (%s) for %s from %s: new=%s late=%s", event.name, key, workflow_id, sender, new, event.late)
    return JsonResponse(_event(workflow_id, event, duplicate=not new), status=201 if new else 200)


SIGNATURE_TOLERANCE = timedelta(minutes=5)  # a signed request older (or newer) than this is refused: a replay


def _signed_by(request: HttpRequest) -> str:
    """The sender's name of a request signed as our alert webhook is (``X-Recovery-Sender``,
    ``X-Recovery-Timestamp``, ``X-Recovery-Signature: sha256=`` HMAC-SHA256 of "timestamp.body"
    under RECOVERY_EVENT_SIGNING_SECRET), checked; "" for a request that is not signed (a token's)."""
    presented = request.headers.get("X-Recovery-Signature")
    if presented is None:
        return ""
    secret = settings.RECOVERY_EVENT_SIGNING_SECRET
    sender = (request.headers.get("X-Recovery-Sender") or "").strip()
    timestamp = request.headers.get("X-Recovery-Timestamp") or ""
    if not secret:
        raise ApiError(401, "signed events are not accepted here (RECOVERY_EVENT_SIGNING_SECRET is not set)")
    if not sender or len(sender) > 60 or not timestamp.isdigit():
        raise ApiError(401, "a signed event names its sender (X-Recovery-Sender) and its time (X-Recovery-Timestamp)")
    # Wall time, not the engine's clock: how long ago another system signed it.
    if abs(time.time() - int(timestamp)) > SIGNATURE_TOLERANCE.total_seconds():
        raise ApiError(401, "the signed event's timestamp is more than 5 minutes away from now: sign it again")
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + request.body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(presented.encode(), f"sha256={digest}".encode()):
        raise ApiError(401, "the event's signature does not match its body")
    return sender


def _body(request: HttpRequest) -> dict[str, Any]:
    data = object_body(request, FIELDS, '{"event": …, "key": …, "payload": {…}}')
    if not isinstance(data.get("event"), str) or not data["event"].strip():
        raise ApiError(400, "event (required) is the name of the event, a string")
    if not isinstance(data.get("key", ""), str):
        raise ApiError(400, "key is a string: the sender's idempotency key")
    return data


def _key(request: HttpRequest, body: dict[str, Any]) -> str:
    """The sender's idempotency key: the body's, or the ``Idempotency-Key`` header's; both given,
    they must agree. None at all: the transition refuses it (400)."""
    in_body = body.get("key", "").strip()
    in_header = (request.headers.get("Idempotency-Key") or "").strip()
    if in_body and in_header and in_body != in_header:
        raise ApiError(400, "the body's key and the Idempotency-Key header differ; send one key")
    return in_body or in_header


def _event(workflow_id: str, event: RunEvent, *, duplicate: bool) -> dict[str, Any]:
    return {
        "workflow_id": workflow_id,
        "event": event.name,
        "key": event.key,
        "late": event.late,
        "received_at": event.received_at.isoformat(),
        "step": event.step_name,
        "duplicate": duplicate,
    }
