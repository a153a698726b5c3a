"""Incident controls for automation (issue 37): a system holding a token issued with
``--may-pause`` for a workflow pauses it, or one of its steps, and releases it — a canary first,
or the rest in waves — through the same transitions as the console and ``manage.py``.

    GET  /api/workflows/<name>/pauses
    200 {"pauses": [{"workflow", "step", "paused_by", "paused_at", "reason", "automatic"}]}

    POST /api/workflows/<name>/pause      {"step": "post_ledger_entry", "reason": "ledger outage"}
    201 {"pause": {…}}

    POST /api/workflows/<name>/unpause    {"step": …, "reason": …, "canary": 2}
                                          or {"step": …, "reason": …, "wave_size": 10, "wave_seconds": 60}
    200 {"pause": {…}, "canary": false, "released": [workflow ids], "due": {workflow id: ISO time}}

``step`` is optional (the whole workflow). Audited as ``api:<token name>``. Errors are
``{"error": …}`` and write nothing: 401 no or an unknown or revoked token, 404 an unknown
workflow, 403 a token for another workflow or one not issued ``--may-pause``, 400 a body that
is not a JSON object, an unknown step, a missing reason, bad waves, 409 pausing what is paused
already or releasing what is not paused, 405 any other method."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from recovery import jsoninput
from recovery.api import tokens
from recovery.api.views import MAX_BODY_BYTES, ApiError, _token, _workflow
from recovery.engine.transitions import Waves, workflow_pause, workflow_pauses_in_force, workflow_unpause
from recovery.errors import InvalidTransition, PauseConflict
from recovery.models import WorkflowPause


@csrf_exempt
def pauses(request: HttpRequest, workflow_name: str) -> JsonResponse:
    try:
        _allowed(request, workflow_name, method="GET")
        found = workflow_pauses_in_force(workflow_name)
    except ApiError as exc:
        return exc.response()
    return JsonResponse({"pauses": [_pause(p) for p in found]})


@csrf_exempt
def pause(request: HttpRequest, workflow_name: str) -> JsonResponse:
    try:
        actor = _allowed(request, workflow_name, method="POST")
        body = _body(request, {"step", "reason"})
        paused = _done(
            workflow_pause, workflow=workflow_name, step_name=body.get("step", ""), actor=actor, reason=body["reason"]
        )
    except ApiError as exc:
        return exc.response()
    return JsonResponse({"pause": _pause(paused)}, status=201)


@csrf_exempt
def unpause(request: HttpRequest, workflow_name: str) -> JsonResponse:
    try:
        actor = _allowed(request, workflow_name, method="POST")
        body = _body(request, {"step", "reason", "canary", "wave_size", "wave_seconds"})
        canary = body.get("canary", 0)
        if not isinstance(canary, int) or isinstance(canary, bool):
            raise ApiError(400, "canary must be a whole number of runs")
        if canary and ("wave_size" in body or "wave_seconds" in body):
            raise ApiError(400, "a canary is released at once: canary or waves, not both")
        done = _done(
            workflow_unpause,
            workflow=workflow_name,
            step_name=body.get("step", ""),
            actor=actor,
            reason=body["reason"],
            canary=canary,
            waves=_waves(body),
        )
    except ApiError as exc:
        return exc.response()
    return JsonResponse(
        {
            "pause": _pause(done["pause"]),
            "canary": done["canary"],
            "released": done["released"],
            "due": {workflow_id: when.isoformat() for workflow_id, when in done["due"].items()},
        }
    )


def _allowed(request: HttpRequest, workflow_name: str, *, method: str) -> str:
    """The actor a permitted request acts as (``api:<token name>``)."""
    if request.method != method:
        raise ApiError(405, f"method {request.method} not allowed; {method} it", headers={"Allow": method})
    token = _token(request)
    workflow = _workflow(workflow_name)
    if not tokens.may_pause(token, workflow.name):
        raise ApiError(403, f"this token may not pause or release {workflow.name!r} (issue one with --may-pause)")
    return f"api:{token.name}"


def _body(request: HttpRequest, allowed: set[str]) -> dict[str, Any]:
    if len(request.body) > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is larger than {MAX_BODY_BYTES // 1024} KiB")
    try:
        data = jsoninput.loads(request.body, what="the body")
    except jsoninput.Refused as exc:
        raise ApiError(400, str(exc)) from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    if not isinstance(data.get("step", ""), str) or not isinstance(data.get("reason"), str):
        raise ApiError(400, "reason (required) and step are strings")
    return data


def _waves(body: dict[str, Any]) -> Waves:
    try:
        return Waves.parse(body.get("wave_size"), body.get("wave_seconds"))
    except InvalidTransition as exc:
        raise ApiError(400, str(exc)) from None


def _done(transition, **arguments):
    try:
        return transition(**arguments)
    except PauseConflict as exc:
        raise ApiError(409, str(exc)) from None
    except InvalidTransition as exc:
        raise ApiError(400, str(exc)) from None


def _pause(p: WorkflowPause) -> dict[str, Any]:
    return {
        "workflow": p.workflow_name,
        "step": p.step_name,
        "paused_by": p.paused_by,
        "paused_at": p.paused_at.isoformat(),
        "reason": p.reason,
        "automatic": p.automatic,
        "released_at": p.released_at.isoformat() if p.released_at else None,
    }
