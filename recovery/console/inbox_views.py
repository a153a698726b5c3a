"""The Inbox (issue 38): everything waiting for a person, oldest first (recovery.inbox), filtered by
role, workflow, tenant, age and kind — each item with its run, who may act, the deadline and what
happens at it, who took it, and "I take this" (a transition, audited; the run page's Decide)."""

from __future__ import annotations

from datetime import timedelta

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_safe

from recovery import clock, inbox
from recovery.http import permission_required
from recovery.permissions import can, role_named, role_of
from recovery.registry import all_workflows

AGES = (("", "any age"), ("1", "over an hour"), ("24", "over a day"), ("72", "over three days"))


@require_safe
@permission_required("view")
def inbox_page(request: HttpRequest) -> HttpResponse:
    now = clock.now()
    query = request.GET
    role = query.get("role", "") if query.get("role") in ("operator", "supervisor") else ""
    hours = query.get("older_than", "")
    kind = query.get("kind", "") if query.get("kind") in inbox.KINDS else ""
    items = inbox.items(
        now,
        role=role,
        workflow=query.get("workflow", ""),
        tenant=query.get("tenant", "").strip(),
        older_than=timedelta(hours=int(hours)) if hours.isdigit() else None,
        kind=kind,
    )
    mine = role_of(request.user)
    rows = [
        {
            "item": item,
            "kind": inbox.KINDS[item.kind],
            "may_take": item.kind != "four_eyes"
            and can(request.user, "take")
            and mine >= role_named(item.role)
            and item.assignee != request.user.get_username(),
        }
        for item in items
    ]
    context = {
        "rows": rows,
        "now": now,
        "filters": {
            "role": role,
            "workflow": query.get("workflow", ""),
            "tenant": query.get("tenant", ""),
            "older_than": hours,
            "kind": kind,
        },
        "workflows": sorted({w.name for w in all_workflows()}),
        "kinds": inbox.KINDS,
        "ages": AGES,
    }
    return render(request, "console/inbox.html", context)
