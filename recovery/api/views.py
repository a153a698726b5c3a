"""The event ingestion API: another system delivers a business event and the engine starts
its run, or finds the run that event already started.

    POST /api/events/<workflow_name>[?version=N]
    Authorization: Bearer rc_…
    {"tenant": "acme", "invoice_id": "INV-1001", "text": "…"}

    201 {"workflow_id": "invoice:acme:INV-1001", "state": "pending", "created": true}
    200 the same, "created": false — a redelivery of the same event (same run)

A batch is a JSON array of up to MAX_BATCH events, started together
(``transitions.run_start_many``) and answered one by one, in order:

    207 {"results": [{"index": 0, "status": 201, "workflow_id": …, "state": "pending", "created": true},
                     {"index": 1, "status": 409, "workflow_id": …, "error": "… a different input …"},
                     {"index": 2, "status": 400, "error": "invoice_id: Field required"}]}

each item with the status that event alone would have had; a refused event refuses nothing else.

``?version=N`` starts the run on a registered older version of the workflow (a canary, a test)
instead of the current one; it stays outside the body, which is the event's own.

Senders deliver at least once; that is safe because the workflow id comes from the event.
Errors are ``{"error": …}`` (plus ``"fields"`` for validation) and write nothing: 401 no or
an unknown or revoked token, 404 unknown workflow, 403 a token for another workflow, 400 a
body that is not a JSON object or does not validate (or a version not registered), 413 a body
over 256 KiB, 409 the same workflow id with a different input, 405 any method but POST. Token auth, no cookies: no CSRF.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import pydantic
from django.db import InterfaceError, OperationalError, connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from recovery import jsoninput
from recovery.api import tokens
from recovery.engine.transitions import run_start, run_start_many
from recovery.errors import StartConflict
from recovery.models import WorkflowRun
from recovery.registry import version_number
from recovery.workflow import Workflow, get_workflow

log = logging.getLogger("recovery.api")

MAX_BODY_BYTES = jsoninput.MAX_BYTES
RETRY_AFTER_SECONDS = 5  # what a 503 asks of the sender while the database is out of reach
MAX_DEPTH = jsoninput.MAX_DEPTH  # objects and arrays inside one another (recovery.jsoninput)
MAX_BATCH = 1000  # events in one request (an array): started together, answered one by one


class ApiError(Exception):
    """A request refused with ``status``; nothing was written."""

    def __init__(
        self, status: int, message: str, *, fields: dict[str, str] | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.fields = fields
        self.headers = headers or {}

    def response(self) -> JsonResponse:
        body: dict[str, Any] = {"error": self.message}
        if self.fields:
            body["fields"] = self.fields
        response = JsonResponse(body, status=self.status)
        for name, value in self.headers.items():
            response[name] = value
        return response


@csrf_exempt
def events(request: HttpRequest, workflow_name: str) -> JsonResponse:
    try:
        if request.method != "POST":
            raise ApiError(405, f"method {request.method} not allowed; POST the event", headers={"Allow": "POST"})
        token = _token(request)
        workflow = _workflow(workflow_name)
        if not tokens.may_start(token, workflow.name):
            raise ApiError(403, f"this token may not start {workflow.name!r} runs")
        workflow = _version(workflow, request.GET.get("version"))
        data = _json_body(request)
        if isinstance(data, list):
            return _start_many(workflow, data, actor=f"api:{token.name}")
        run, created = _start(workflow, data, actor=f"api:{token.name}")
    except ApiError as exc:
        return exc.response()
    except (OperationalError, InterfaceError) as exc:
        # The database is restarting or out of reach: nothing was written; the sender should try
        # again (the same event is the same run), not take it as refused.
        return unavailable(exc, "event API")
    log.info("event for %s from token %r: %s (%s)", workflow.name, token.name, run.workflow_id, created)
    return JsonResponse(
        {"workflow_id": run.workflow_id, "version": run.workflow_version, "state": run.state, "created": created},
        status=201 if created else 200,
    )


def unavailable(exc: Exception, where: str) -> JsonResponse:
    """A 503 with Retry-After for a database out of reach (restarting, failing over): nothing was
    written, and the sender sends the same request again (the same event, the same key)."""
    log.warning("%s: database unavailable: %s: %s", where, type(exc).__name__, exc)
    connection.close()
    said = "the database is unavailable right now; nothing was written: send the event again"
    return ApiError(503, said, headers={"Retry-After": str(RETRY_AFTER_SECONDS)}).response()


def _token(request: HttpRequest) -> tokens.ApiToken:
    presented = tokens.bearer_token(request.headers.get("Authorization"))
    if presented is None:
        raise ApiError(
            401, "an Authorization: Bearer token is required", headers={"WWW-Authenticate": 'Bearer realm="api"'}
        )
    token = tokens.authenticate(presented)
    if token is None:
        raise ApiError(
            401, "unknown or revoked token", headers={"WWW-Authenticate": 'Bearer realm="api", error="invalid_token"'}
        )
    return token


def _workflow(name: str) -> Workflow:
    try:
        return get_workflow(name)
    except LookupError:
        raise ApiError(404, f"unknown workflow {name!r}") from None


def _version(workflow: Workflow, version: str | None) -> Workflow:
    """The version to start: the current one, or the registered one ``?version=N`` names."""
    if version is None:
        return workflow
    number = version_number(version)
    if number is None:
        raise ApiError(400, f"version must be a whole number, not {version[:20]!r}")
    try:
        return get_workflow(workflow.name, number)
    except LookupError as exc:
        raise ApiError(400, str(exc)) from None


def object_body(request: HttpRequest, allowed: Iterable[str], shape: str) -> dict[str, Any]:
    """The request's JSON object (within an event's bounds), holding no field but ``allowed``;
    ``shape`` shows what it looks like, for the 400."""
    data = _json_body(request)
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object: {shape}")
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    return data


def _json_body(request: HttpRequest) -> dict[str, Any] | list[Any]:
    try:
        declared = int(request.headers.get("Content-Length") or 0)
    except ValueError:
        raise ApiError(400, "invalid Content-Length") from None
    if declared > MAX_BODY_BYTES or len(request.body) > MAX_BODY_BYTES:
        raise ApiError(413, f"the event is larger than {MAX_BODY_BYTES // 1024} KiB")
    try:
        data = jsoninput.loads(request.body, what="the body")
    except jsoninput.Refused as exc:
        raise ApiError(400, str(exc)) from None
    if isinstance(data, list):
        if not 1 <= len(data) <= MAX_BATCH:
            raise ApiError(400, f"a batch is an array of 1 to {MAX_BATCH} events; this one has {len(data)}")
    elif not isinstance(data, dict):
        raise ApiError(400, "the event must be a JSON object (or a batch: an array of them)")
    try:
        jsoninput.check_storable(data, what="the event")
    except jsoninput.Refused as exc:
        raise ApiError(400, str(exc), fields=exc.fields) from None
    return data


def _start(workflow: Workflow, data: dict[str, Any], *, actor: str) -> tuple[WorkflowRun, bool]:
    try:
        return run_start(workflow=workflow, data=data, actor=actor)
    except pydantic.ValidationError as exc:
        raise ApiError(400, "the event does not match the workflow's input", fields=_fields(exc)) from None
    except StartConflict as exc:
        raise ApiError(409, str(exc)) from None
    # a workflow without a schema: its workflow id needs a field; run_start refuses an id too long
    except (ValueError, KeyError, TypeError) as exc:
        raise ApiError(400, f"the event cannot start {workflow.name}: {exc}") from None


# A batch's items: (HTTP status, "created" flag) by outcome.
BATCH_STATUS = {"created": (201, True), "existing": (200, False), "conflict": (409, False), "invalid": (400, False)}


def _start_many(workflow: Workflow, events: list[Any], *, actor: str) -> JsonResponse:
    """A batch: 207 with one result per event, in order, each with the status the event alone
    would have had; a refused event refuses nothing else."""
    results = []
    for started in run_start_many(workflow=workflow, events=events, actor=actor):
        status, created = BATCH_STATUS[started.outcome]
        item: dict[str, Any] = {"index": started.index, "status": status}
        if started.run is not None:
            item.update(workflow_id=started.run.workflow_id, state=started.run.state, created=created)
        else:
            item.update(error=started.error, **({"workflow_id": started.workflow_id} if started.workflow_id else {}))
        results.append(item)
    counts = {outcome: sum(1 for r in results if r["status"] == s) for outcome, (s, _) in BATCH_STATUS.items()}
    log.info("batch of %d events for %s from %s: %s", len(events), workflow.name, actor, counts)
    return JsonResponse({"results": results}, status=207)


def _fields(exc: pydantic.ValidationError) -> dict[str, str]:
    fields: dict[str, str] = {}
    for error in exc.errors(include_url=False, include_input=False):
        path = ".".join(str(part) for part in error["loc"]) or "__root__"
        fields[path] = f"{fields[path]}; {error['msg']}" if path in fields else error["msg"]
    return fields
