"""Send a run the event its wait waits for, from its page (an operator: an approver who answered by
phone, a reply that came by mail). Through the same transition as the event API and
``manage.py send_event``: validated by the wait's schema, recorded under a key the form carries
(a second click of the same form is the same event), audited with the operator's name. Bad
input is answered on the page, and nothing is written."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse

from recovery.actions import parse_object
from recovery.console import views
from recovery.engine import transitions
from recovery.errors import EventConflict, InvalidTransition, NotPermitted
from recovery.http import flash, not_allowed, permission_required, require_methods
from recovery.models import WorkflowRun
from recovery.permissions import can


@require_methods("POST")
@permission_required("view")
def run_event(request: HttpRequest, workflow_id: str) -> HttpResponse:
    if not can(request.user, "send_event"):
        return flash(request, not_allowed(request, "send_event", "runs"), status=403)
    event = request.POST.get("event", "")
    try:
        payload = parse_object(request.POST.get("payload", ""), f"the payload of event {event!r}")
        kept, new = transitions.run_deliver_event(
            workflow_id=workflow_id, event=event, key=request.POST.get("key", ""), payload=payload, actor=request.user
        )
    except WorkflowRun.DoesNotExist:
        return flash(request, f"no run {workflow_id}", status=404)
    except EventConflict as exc:
        return flash(request, str(exc), status=409)
    except NotPermitted as exc:  # an escalated wait: its event from a person of the escalation's role
        return flash(request, str(exc), status=403)
    except InvalidTransition as exc:
        return flash(request, str(exc), status=400)
    if not new:
        message = f"event {event} was sent already (the same form): nothing new"
    elif kept.late:
        message = f"event {event} recorded late: its wait had ended, it is not applied"
    else:
        message = f"event {event} sent: the run goes on from it"
    if not request.htmx:
        return redirect(reverse("console:run", args=[workflow_id]))
    return views._render_run(request, workflow_id, message=message)
