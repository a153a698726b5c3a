"""Restart a run from a step with a corrected input (a supervisor): the form (the step, what is
corrected, the JSON prefilled with what the run holds), then the difference and each effect's
fate — what is undone first, what stands beside a second one — and only then the confirmation,
which goes through the same transition as ``manage.py recover restart`` (or asks a second
supervisor, where the workflow puts restarts behind four eyes). Bad input is a 400 on the form,
and nothing is written."""

from __future__ import annotations

import json

from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse

from recovery import clock
from recovery.console import selectors, services
from recovery.engine import transitions
from recovery.errors import InvalidTransition, NotPermitted, RunChanged
from recovery.http import flash, not_allowed, permission_required, require_methods
from recovery.models import WorkflowRun
from recovery.permissions import can

EDITS = (("input", "the run's input"), ("intent", "the step's intent"))


@require_methods("GET", "HEAD", "POST")
@permission_required("view")
def run_restart(request: HttpRequest, workflow_id: str) -> HttpResponse:
    """GET: the form. POST ``stage=preview``: the difference and the effects, to confirm;
    ``stage=confirm``: the restart (or its four-eyes request)."""
    if not can(request.user, "restart"):
        return flash(request, not_allowed(request, "restart", "runs"), status=403)
    try:
        detail = selectors.run_detail(workflow_id)
    except WorkflowRun.DoesNotExist:
        return flash(request, f"no run {workflow_id}", status=404)
    data = request.POST if request.method == "POST" else request.GET
    form = _form(detail, request.user, data)
    if request.method != "POST":
        return _page(request, detail, form)
    try:
        if data.get("stage") != "confirm":
            situation = transitions.Situation.of(detail["run"], detail["steps"], clock.now())
            edited, value = services.parse_correction(form["edit"], form["json"])
            plan = transitions.restart_preview(
                situation,
                form["step"],
                actor=request.user,
                edited=edited,
                value=value,
                effects_stand=form["effects_stand"],
            )
            return _page(request, detail, form, plan=plan)
        services.apply_action(
            action="restart",
            workflow_id=workflow_id,
            step=form["step"],
            reason=data.get("reason", ""),
            expect=data.get("version") or None,
            remote_ref="",
            correction=(form["edit"], form["json"]),
            effects_stand=form["effects_stand"],
            actor=request.user,
        )
    except RunChanged as exc:
        return _page(request, detail, form, error=str(exc), status=409)
    except NotPermitted as exc:
        return _page(request, detail, form, error=str(exc), status=403)
    except InvalidTransition as exc:
        return _page(request, detail, form, error=str(exc), status=400)
    return redirect(reverse("console:run", args=[workflow_id]))


def _form(detail: dict, user, data) -> dict:
    """The form as posted (or first shown): the step (the first one a restart is offered from,
    unless chosen), what is corrected, its JSON (prefilled from the run), whether effects stand."""
    steps = [s for name, s in services.offered(detail, user, now=clock.now()) if name == "restart"]
    step = data.get("step") or (steps[0] if steps else "")
    edit = data.get("edit", "input")
    text = data.get("json")
    if text is None:
        row = next((s for s in detail["steps"] if s.step_name == step), None)
        current = detail["run"].input if edit != "intent" or row is None else (row.intent or {})
        text = json.dumps(current, indent=2, sort_keys=True, ensure_ascii=False)
    workflow = detail["workflow"]
    stands = [s.name for s in workflow.steps if s.second_effect] if workflow is not None else []
    return {
        "steps": steps,
        "step": step,
        "edit": edit,
        "edits": EDITS,
        "json": text,
        "effects_stand": data.get("effects_stand") in ("on", "true", "yes"),
        "second_effects": stands,
        "reason": data.get("reason", ""),
    }


def _page(request, detail, form, *, plan=None, error: str = "", status: int = 200) -> HttpResponse:
    run = detail["run"]
    workflow = detail["workflow"]
    context = {
        "run": run,
        "form": form,
        "plan": plan,
        "changes": [transitions.change_text(c) for c in plan.diff] if plan else [],
        "error": error,
        "version": transitions.run_version(run),
        "four_eyes": workflow is not None and "restart" in workflow.four_eyes,
    }
    return render(request, "console/restart.html", context, status=status)
