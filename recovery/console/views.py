"""The operator console: thin views. Each parses its input, checks the permission on the
server, calls one domain function (the same transitions the executor uses), and chooses a
template. htmx swaps: 2xx and the user-fixable 400/403/409 are swapped (see base.html's
htmx-config meta); errors of a form land in its ``#flash`` area via HX-Retarget."""

from __future__ import annotations

import hashlib
from urllib.parse import quote

from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import RFC3986_SUBDELIMS
from django.views.decorators.vary import vary_on_headers
from django_htmx.http import HttpResponseStopPolling

from recovery import clock, counts, why
from recovery.actions import PERMISSION_OF
from recovery.console import alert_lists, call_forms, incidents, overview, panel, selectors, services
from recovery.engine.transitions import (
    TERMINAL_RUN_STATES,
    lease_is_live,
    run_version,
    workflow_pause,
    workflow_unpause,
)
from recovery.errors import InvalidTransition, NotPermitted, PauseConflict, RunChanged
from recovery.http import flash, not_allowed, permission_required, require_POST, require_safe
from recovery.models import RunState, StepState, WorkflowRun
from recovery.permissions import can, role_of

# --- runs list --------------------------------------------------------------------------


@require_safe
@vary_on_headers("HX-Request")
@permission_required("view")
def runs_list(request: HttpRequest) -> HttpResponse:
    now = clock.now()
    filters = selectors.RunFilters.from_params(request.GET)
    # htmx refreshes one part at a time (the table every 15 s, the counts every 10 s): compute
    # only what that part shows. The counts are most of the page's SQL.
    partial = request.htmx.target if request.htmx and request.htmx.target in ("counts", "runs-table") else None
    context = {
        "filters": filters,
        "stuck_labels": counts.STUCK_LABELS,
        "ages": list(selectors.AGES),
        "states": list(counts.list_states().items()),
        "can_bulk": can(request.user, "bulk"),
        "bulk_actions": services.bulk_choices(request.user),
        "bulk_targets": services.bulk_targets(request.user),
        "selected": set(request.GET.getlist("run")),
        "select_page": request.GET.get("select") == "page",
        # The parts refresh themselves with the filters and the page only: the selection they
        # send is the boxes checked now, never the one this page was first asked with.
        "refresh_query": filters.query(after=filters.after, mark=filters.mark),
        "headers": filters.headers(),  # each sortable column's link and aria-sort
        "now": now,
    }
    if partial != "counts":
        runs, next_cursor = selectors.runs_page(filters, now=now)
        why.for_page(runs, now=now)
        prefix = reverse("console:run", args=["-"])[:-1]  # once a page, not once a row
        for run in runs:
            run.href = run_href(run.workflow_id, prefix)
        context.update(
            runs=runs,
            narrowed=filters.describe(),
            widen=selectors.RunFilters(q=filters.q).query() if filters.q and filters.describe() else "",
            next_cursor=next_cursor,
            next_query=filters.query(**filters.cursor_of(runs[-1])) if next_cursor else "",
            first_query=filters.query(),
        )
    if partial == "counts":
        states = counts.state_counts()
        context.update(state_counts=states, stuck_counts=counts.stuck_counts(now=now, states=states))
        context["total"] = selectors.total(filters, now=now)  # "1,234 runs" match the filters
    elif partial is None:
        # The whole page comes without its numbers: the chips are there to click at once, and
        # their counts (a third of the page's SQL) follow in the counts part's own request.
        context.update(counting=True, **selectors.uncounted())
        workflows = selectors.workflow_names()  # the filter's choices, old runs' names included
        context.update(
            workflows=workflows,
            unregistered=selectors.unregistered(workflows),
            version_choices=selectors.version_choices(filters, now=now),
            pauses=incidents.pauses(),  # the incident's pauses in force, at the top
        )
    return render(request, f"console/runs.html#{partial}" if partial else "console/runs.html", context)


@require_POST
@permission_required("bulk")
def bulk_action(request: HttpRequest) -> HttpResponse:
    """A dry run first (how many runs, which would change, which are refused and why); the
    action applies only when that page's form comes back confirmed, to the runs it listed."""
    filters = selectors.RunFilters.from_params(request.POST)
    try:
        bulk = services.bulk_selection(
            action=request.POST.get("action", ""),
            reason=request.POST.get("reason", ""),
            workflow_ids=request.POST.getlist("run"),
            all_matching=request.POST.get("all_matching") == "1",
            filters=filters,
            to_version=request.POST.get("to_version"),
            wave_size=request.POST.get("wave_size"),
            wave_seconds=request.POST.get("wave_seconds"),
        )
    except ValueError as exc:
        return flash(request, str(exc), status=400)
    if not can(request.user, PERMISSION_OF[bulk.action]):
        return flash(request, not_allowed(request, PERMISSION_OF[bulk.action], "runs"), status=403)
    if request.POST.get("confirm") == "yes":
        result = services.bulk_apply(bulk, actor=request.user)
    else:
        result = services.bulk_preview(bulk, actor=request.user)
    return render(request, "console/bulk_result.html", {"result": result, "back": filters.query()})


# --- one run ---------------------------------------------------------------------------


@require_safe
@vary_on_headers("HX-Request")
@permission_required("view")
def run_detail(request: HttpRequest, workflow_id: str) -> HttpResponse:
    return _render_run(request, workflow_id)


def _render_run(request: HttpRequest, workflow_id: str, *, message: str = "", status: int = 200) -> HttpResponse:
    try:
        detail = selectors.run_detail(workflow_id)
    except WorkflowRun.DoesNotExist:
        # Rendered here, not raised: under DEBUG, Django answers any Http404 with its own page.
        return _run_not_found(request, workflow_id)
    now = clock.now()
    pairs = services.offered(detail, request.user, now=now)
    beyond = services.beyond_role(detail, pairs, now=now)
    approvals = services.pending_approvals(detail["run"], detail["workflow"], request.user)
    detail.update(
        **panel.action_panel(detail, request.user, now=now, pairs=pairs),
        decision_tools=services.decision_tools(detail, request.user, now=now, pairs=pairs),
        restart_from=[step for name, step in pairs if name == "restart"],
        restarts=services.restarts(detail["run"]),
        event_forms=call_forms.with_takes(services.event_forms(detail, request.user), detail, pairs),
        call_forms=call_forms.call_forms(detail, request.user, pairs),
        approvals=approvals,
        why=why.why_not_moving(
            detail["run"],
            detail["steps"],
            now=now,
            approvals=[a["request"] for a in approvals],
            outbox=detail["outbox"],
        ),
        four_eyes=services.four_eyes_labels(detail["workflow"]),
        version=run_version(detail["run"]),
        role=role_of(request.user).name.lower(),
        beyond_role=beyond,
        partly_compensated=detail["run"].state == RunState.COMPLETED
        and any(s.state == StepState.COMPENSATED for s in detail["steps"]),
        message=message,
        now=now,
        finished=_finished(detail["run"], now),
    )
    detail["seen"] = _live_fingerprint(detail)
    if request.htmx and request.GET.get("live"):
        # The page's poll: its live parts, out of band; the actions stay as the operator left
        # them (a note says when the run has moved on). A finished run stops the polling. While
        # nothing shown has changed, nothing is swapped (204): a list the operator opened, or
        # the mark their keyboard is on, stays as it is.
        if request.GET.get("seen") == detail["seen"] and not detail["finished"]:
            return HttpResponse(status=204)
        detail["moved"] = request.GET.get("shown") != detail["version"]
        response = render(request, "console/run.html#run-live", detail)
        return HttpResponseStopPolling(response.content) if detail["finished"] else response
    template = "console/run.html#run-body" if request.htmx else "console/run.html"
    return render(request, template, detail, status=status)


def _run_not_found(request: HttpRequest, workflow_id: str) -> HttpResponse:
    """The console's 404 for an unknown run id: a search box holding the id, and runs whose
    id is close (the same id in another case, or the same prefix before its last ':')."""
    if request.htmx:
        return flash(request, f"no run {workflow_id}", status=404)
    context = {"workflow_id": workflow_id, "close": _close_runs(workflow_id)}
    return render(request, "console/not_found.html", context, status=404)


def _close_runs(workflow_id: str, *, limit: int = 8) -> list[WorkflowRun]:
    """Runs whose id is close to ``workflow_id``: the same id in another case first, then the
    newest runs sharing its prefix up to the last ':' (``invoice:acme:`` for
    ``invoice:acme:X``). Two indexed look-ups, at most ``limit`` runs."""
    same = list(WorkflowRun.objects.filter(workflow_id__iexact=workflow_id).order_by("-pk")[:limit])
    prefix = workflow_id.rpartition(":")[0]
    if prefix and len(same) < limit:
        rest = WorkflowRun.objects.filter(workflow_id__startswith=prefix + ":").exclude(pk__in=[r.pk for r in same])
        same += list(rest.order_by("-pk")[: limit - len(same)])
    return same


def run_href(workflow_id: str, prefix: str) -> str:
    """``reverse("console:run", args=[workflow_id])``, quoted as Django quotes it, after the
    ``prefix`` of that URL: resolving the pattern for every row was a twentieth of the runs
    list's rendering."""
    return prefix + quote(workflow_id, safe=RFC3986_SUBDELIMS + "/~:@")


def _live_fingerprint(detail: dict) -> str:
    """What the live parts show, in short: the run's version (every change of it, of its steps,
    of its outbox and its audit trail bumps it), the sentence that reads the clock, and the
    approvals waiting on it, and its alerts with their deliveries (raised and sent without a
    change of the run)."""
    approvals = ",".join(str(a["request"].pk) for a in detail["approvals"])
    alerts = ",".join(f"{a.pk}:{a.state}:{[d.state for d in a.deliveries.all()]}" for a in detail["alerts"])
    text = f"{detail['version']}|{detail['run'].revision}|{detail['why']}|{approvals}|{alerts}|{detail['finished']}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _finished(run: WorkflowRun, now) -> bool:
    """Nothing will change the run by itself any more: no poll needed."""
    return run.state in TERMINAL_RUN_STATES and not lease_is_live(run, now)


@require_POST
@permission_required("act")
def run_action(request: HttpRequest, workflow_id: str) -> HttpResponse:
    action = request.POST.get("action", "")
    permission = PERMISSION_OF.get(action)
    if permission is None:
        return flash(request, f"unknown action {action!r}", status=400)
    if not can(request.user, permission):
        return flash(request, not_allowed(request, permission, "runs"), status=403)
    if request.POST.get("confirm") == "ask" and request.POST.get("confirmed") != "yes":
        # A form whose button asks first, posted without its dialog (no JavaScript): ask here.
        asked = _confirmation(request, workflow_id, action)
        if asked is not None:
            return asked
    try:
        message = services.apply_action(
            action=action,
            workflow_id=workflow_id,
            step=request.POST.get("step") or None,
            reason=request.POST.get("reason", ""),
            expect=request.POST.get("version") or None,
            remote_ref=request.POST.get("remote_ref", ""),
            result=request.POST.get("result"),
            decision=request.POST.get("decision"),
            hours=request.POST.get("hours"),
            to_version=request.POST.get("to_version"),
            effects_stand=request.POST.get("effects_stand") == "on",
            correction=(request.POST.get("edit", ""), request.POST.get("json", "")),
            actor=request.user,
            request_id=request.POST.get("request") or None,
        )
    except WorkflowRun.DoesNotExist:
        return flash(request, f"no run {workflow_id}", status=404)
    except RunChanged as exc:
        return flash(request, str(exc), status=409)
    except NotPermitted as exc:
        return flash(request, str(exc), status=403)
    except InvalidTransition as exc:
        return flash(request, str(exc), status=400)
    if not request.htmx:
        return redirect(reverse("console:run", args=[workflow_id]))
    return _render_run(request, workflow_id, message=message)


def _confirmation(request: HttpRequest, workflow_id: str, action: str) -> HttpResponse | None:
    """The page that asks what the button's dialog asks, the posted form kept to confirm it
    (None when the action asks nothing now: it is performed)."""
    try:
        detail = selectors.run_detail(workflow_id)
    except WorkflowRun.DoesNotExist:
        return flash(request, f"no run {workflow_id}", status=404)
    step = request.POST.get("step") or None
    asked = panel.question(detail, request.user, now=clock.now(), action=action, step=step)
    if not asked:
        return None
    kept = [(k, v) for k, v in request.POST.items() if k not in ("csrfmiddlewaretoken", "confirmed")]
    context = {"run": detail["run"], "question": asked, "fields": kept, "action": action, "step": step}
    return render(request, "console/confirm.html", context)


# --- dashboard ----------------------------------------------------------------------------


@require_safe
@permission_required("view")
def dashboard(request: HttpRequest) -> HttpResponse:
    now = clock.now()
    # The dashboard's numbers, and the snoozed alerts (who silenced which, until when, why).
    context = {**overview.dashboard(now=now), "snoozed": alert_lists.snoozed(now)}
    context["pauses"] = incidents.pauses()
    if can(request.user, "pause_workflow"):
        context["pause_choices"] = incidents.choices()
    return render(request, "console/dashboard.html", context)


@require_POST
@permission_required("view")
def workflow_pauses(request: HttpRequest) -> HttpResponse:
    """A supervisor pauses a workflow (or one step of it), or releases a pause in force."""
    if not can(request.user, "pause_workflow"):
        return flash(request, not_allowed(request, "pause_workflow", "workflows"), status=403)
    action = request.POST.get("action", "")
    perform = {"pause": workflow_pause, "unpause": workflow_unpause}.get(action)
    if perform is None:
        return flash(request, f"unknown action {action!r}", status=400)
    workflow, step = incidents.parse_target(request.POST.get("target", ""))
    arguments = {
        "workflow": workflow,
        "step_name": step,
        "actor": request.user,
        "reason": request.POST.get("reason", ""),
    }
    try:
        if action == "unpause":
            arguments.update(incidents.release_options(request.POST))
        perform(**arguments)
    except NotPermitted as exc:
        return flash(request, str(exc), status=403)
    except PauseConflict as exc:  # paused already, or not paused: someone else was first
        return flash(request, str(exc), status=409)
    except InvalidTransition as exc:
        return flash(request, str(exc), status=400)
    return redirect(reverse("console:dashboard") + "#workflow-pauses")
