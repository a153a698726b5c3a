"""A person's decisions, sent by a system on their behalf (issue 38): a chat bot holding a token
issued for the workflow with ``--may-decide`` lists what waits for people and approves, edits,
rejects or answers a held tool call for a named user — whose role is checked, as in the console,
through ``perform`` and the same transitions; audited as that user, "via api:<token name>". A
token that only starts runs (the system sending invoices) does not decide them.

    GET  /api/inbox?role=supervisor&workflow=dispute&tenant=acme&older_than=3600&kind=call
    200 {"items": [{"kind": "call", "workflow_id": …, "step": …, "role": …, "what": …, "deadline": …,
                    "then": …, "overdue": false, "assignee": "", …}]}   (the token's workflow only)

    POST /api/runs/<workflow id>/decisions
    {"call": "resolve_dispute:2:0:issue_credit_note", "decision": "approve" | "edit" | "reject" | "answer",
     "arguments": {…} (edit), "answer": {…} (answer), "reason": "…", "as": "alice", "key": "chat:8812"}
    201 {"workflow_id": …, "call": …, "decision": "approve", "by": "alice", "state": "pending",
         "duplicate": false}
    200 the same, "duplicate": true — the same decision under the same key again (nothing new)

A reject's reason is what the model reads. Errors are ``{"error": …}`` and write nothing: 401 no or
an unknown token, 403 a token for another workflow or not issued ``--may-decide``, or a user whose
role may not decide this call, 404 an unknown run, 400 a body that is not a JSON object (unknown
fields, no reason, no such user or call, arguments the tool's schema refuses), 409 a call decided
already (another decision or key) or not waiting for one, 405 another method."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from recovery import clock, inbox
from recovery.api import tokens
from recovery.api.views import ApiError, _token, object_body
from recovery.engine.transitions import DECISIONS, already_decided, perform
from recovery.errors import DecisionRefused, InvalidTransition, NotPermitted
from recovery.models import StepExecution, WorkflowRun

FIELDS = frozenset({"call", "decision", "arguments", "answer", "reason", "as", "key"})
ACTION = {decision: action for action, decision in DECISIONS.items()}  # "approve" -> "approve_call"


@csrf_exempt
def decide(request: HttpRequest, workflow_id: str) -> JsonResponse:
    try:
        if request.method != "POST":
            raise ApiError(405, f"method {request.method} not allowed; POST the decision", headers={"Allow": "POST"})
        token = _token(request)
        run = WorkflowRun.objects.filter(workflow_id=workflow_id).first()
        if run is None:
            raise ApiError(404, f"no run {workflow_id!r}")
        if not tokens.may_decide(token, run.workflow_name):
            raise ApiError(
                403, f"this token may not decide for {run.workflow_name!r} runs (issue one with --may-decide)"
            )
        body = _body(request)
        action, call, key = ACTION[body["decision"]], body["call"], body.get("key", "")
        user = get_user_model().objects.filter(username=body["as"], is_active=True).first()
        if user is None:
            raise ApiError(400, f"no active user {body['as']!r}: a decision is made by a named person")
        if not StepExecution.objects.filter(run=run, step_name=call).exists():
            raise ApiError(400, f"run {workflow_id} has no call {call!r}")
        if already_decided(run, call, action, key):
            return JsonResponse(_answer(run, call, duplicate=True), status=200)
        given = body.get("arguments") if action == "edit_call" else body.get("answer")
        try:
            perform(
                action,
                workflow_id=workflow_id,
                step_name=call,
                actor=user,
                reason=f"{body['reason'].strip()} (via api:{token.name})",
                decision=given if action in ("edit_call", "answer_call") else None,
                key=key,
            )
        except NotPermitted as exc:
            raise ApiError(403, str(exc)) from None
        except DecisionRefused as exc:
            raise ApiError(400, str(exc)) from None
        except InvalidTransition as exc:
            if already_decided(run, call, action, key):  # the same request, delivered twice at once
                return JsonResponse(_answer(run, call, duplicate=True), status=200)
            raise ApiError(409, str(exc)) from None
    except ApiError as exc:
        return exc.response()
    return JsonResponse(_answer(run, call, duplicate=False), status=201)


def _body(request: HttpRequest) -> dict[str, Any]:
    data = object_body(request, FIELDS, '{"call": …, "decision": …, "reason": …, "as": …}')
    for name in ("call", "reason", "as"):
        if not isinstance(data.get(name), str) or not data[name].strip():
            raise ApiError(400, f"{name} (required) is a non-empty string")
    if data.get("decision") not in ACTION:
        raise ApiError(400, f"decision (required) is one of {', '.join(ACTION)}")
    needs = {"edit": "arguments", "answer": "answer"}.get(data["decision"])
    if needs and not isinstance(data.get(needs), dict):
        raise ApiError(400, f"{data['decision']} needs {needs}: a JSON object")
    if not isinstance(data.get("key", ""), str) or len(data.get("key", "")) > 200:
        raise ApiError(400, "key is a string of at most 200 characters: the sender's idempotency key")
    return data


def _answer(run: WorkflowRun, call: str, *, duplicate: bool) -> dict[str, Any]:
    run.refresh_from_db(fields=["state"])
    approval = StepExecution.objects.get(run=run, step_name=call).approval or {}
    return {
        "workflow_id": run.workflow_id,
        "call": call,
        "decision": approval.get("decision"),
        "by": approval.get("by"),
        "state": run.state,
        "duplicate": duplicate,
    }


def listed(request: HttpRequest) -> JsonResponse:
    """``GET /api/inbox``: what waits for a person in the token's workflows, oldest first."""
    try:
        if request.method != "GET":
            raise ApiError(405, f"method {request.method} not allowed; GET the inbox", headers={"Allow": "GET"})
        token = _token(request)
        query = request.GET
        older = query.get("older_than", "")
        if older and not older.isdigit():
            raise ApiError(400, "older_than is a number of seconds")
        if query.get("kind") and query["kind"] not in inbox.KINDS:
            raise ApiError(400, f"kind is one of {', '.join(inbox.KINDS)}")
        if query.get("role") and query["role"] not in ("operator", "supervisor"):
            raise ApiError(400, "role is operator or supervisor")
        now = clock.now()
        found = inbox.items(
            now,
            role=query.get("role", ""),
            workflow=query.get("workflow", ""),
            tenant=query.get("tenant", ""),
            older_than=timedelta(seconds=int(older)) if older else None,
            kind=query.get("kind", ""),
        )
    except ApiError as exc:
        return exc.response()
    mine = [item.as_json(now) for item in found if tokens.may_decide(token, item.workflow)]
    return JsonResponse({"items": mine})
