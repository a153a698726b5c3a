"""A run's incident controls for automation (issue 37): a system holding a token issued with
``--may-pause`` for a workflow pauses one of its runs, unpauses it, or makes a step waiting for
its retry try now — through ``perform``, the same transitions and checks as the console and
``manage.py recover``, audited as ``api:<token name>``.

    POST /api/runs/<workflow id>/pause       {"reason": "ledger outage"}
    POST /api/runs/<workflow id>/unpause     {"reason": "ledger back"}
    POST /api/runs/<workflow id>/retry_now   {"step": "post_ledger_entry", "reason": "ledger back"}
    200 {"workflow_id": …, "state": "paused", "status": "paused by api:monitor at …: ledger outage"}

``expect`` (optional): the run's version as last read (``show_run --json``'s ``version``); a run
changed since is a 409. Errors are ``{"error": …}`` and write nothing: 401 no or an unknown or
revoked token, 404 an unknown run or action, 403 a token for another workflow or one not issued
``--may-pause``, 400 a body that is not a JSON object, a missing reason or step, or an action the
run's state does not allow (the console's message), 409 a stale ``expect``, 405 any method but POST."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from recovery.api import tokens
from recovery.api.incidents import _body
from recovery.api.views import ApiError, _token
from recovery.engine.transitions import perform
from recovery.errors import InvalidTransition, RunChanged
from recovery.models import WorkflowRun

# What a token may do to a run: the incident controls that stop or restart nothing for good.
ACTIONS = ("pause", "unpause", "retry_now")


@csrf_exempt
def act(request: HttpRequest, workflow_id: str, action: str) -> JsonResponse:
    try:
        if request.method != "POST":
            raise ApiError(405, f"method {request.method} not allowed; POST it", headers={"Allow": "POST"})
        token = _token(request)
        if action not in ACTIONS:
            raise ApiError(404, f"no run action {action!r}: one of {', '.join(ACTIONS)}")
        run = WorkflowRun.objects.filter(workflow_id=workflow_id).only("workflow_name").first()
        if run is None:
            raise ApiError(404, f"no run {workflow_id!r}")
        if not tokens.may_pause(token, run.workflow_name):
            raise ApiError(403, f"this token may not pause or release {run.workflow_name!r} runs (--may-pause)")
        body = _body(request, {"step", "reason", "expect"})
        try:
            done = perform(
                action,
                workflow_id=workflow_id,
                step_name=body.get("step") or None,
                actor=f"api:{token.name}",
                reason=body["reason"],
                expect=body.get("expect"),
            )
        except RunChanged as exc:
            raise ApiError(409, str(exc)) from None
        except InvalidTransition as exc:
            raise ApiError(400, str(exc)) from None
    except ApiError as exc:
        return exc.response()
    return JsonResponse({"workflow_id": done.workflow_id, "state": done.state, "status": done.status_reason})
