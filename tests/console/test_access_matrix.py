"""The permission matrix (issue 7, access control): every URL × every HTTP method × every kind of
caller has one expected answer, written down here as data, and every refusal changes nothing.

The rule, project-wide: the method first (405 for everyone), then who is calling (a console page
redirects an anonymous caller to the login page, the event API and the simulated systems answer
401 without their credential, the admin redirects to its own login), then the role (403). A URL
the resolver knows but this table does not is a failing test (``test_every_url_is_in_the_matrix``).
Per-action permissions, CSRF on every POST; rule 11: a manual retry never bypasses
permission checks."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from types import SimpleNamespace
from urllib.parse import parse_qs, urlencode, urlsplit

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.contrib.sessions.models import Session
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from recovery.actions import PERMISSION_OF
from recovery.api import tokens
from recovery.engine.executor import advance
from recovery.engine.transitions import (
    alert_raise,
    approval_request,
    run_pause,
    run_start,
    run_version,
    sweeper_beat,
    workflow_pause,
)
from recovery.models import (
    Alert,
    ApiToken,
    ApprovalRequest,
    AuditEvent,
    LoginFailure,
    ModelDecision,
    OutboxMessage,
    RunEvent,
    StepExecution,
    WorkflowPause,
    WorkflowRun,
)
from recovery.permissions import Role
from recovery.workflow import get_workflow
from sandbox import faults
from sandbox import services as sandbox_services
from sandbox.models import Fault, IdempotencyRecord, LedgerEntry, Message, Task
from tests.support import receivers
from tests.support.console import failed_run, unknown_run
from tests.support.engine import drive
from tests.support.waits import HELD_CALL

pytestmark = pytest.mark.django_db(databases=["default", "sandbox"])

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
# The four callers of the brief, and a fifth: no session, but the credential the URL's own
# clients use (an API token, the sandbox's key). On a console page it counts for nothing.
CALLERS = ("anonymous", "viewer", "operator", "supervisor", "credential")
ROLE_OF_CALLER = {"viewer": Role.VIEWER, "operator": Role.OPERATOR, "supervisor": Role.SUPERVISOR}

READ = {"GET": 200, "HEAD": 200}


@dataclass(frozen=True)
class Console:
    """A console URL: a session whose role is at least ``role``."""

    role: Role


PUBLIC = "public"  # anyone (the login form, logging out)
TOKEN = "token"  # the event API: Authorization: Bearer <API token>
SANDBOX_KEY = "sandbox-key"  # the simulated systems: Authorization: Bearer <SANDBOX_API_KEY>
METRICS_TOKEN = "metrics-token"  # /metrics: Authorization: Bearer <RECOVERY_METRICS_TOKEN>
ADMIN = "admin"  # Django's admin: staff only; no console role is staff


@dataclass(frozen=True)
class Row:
    """One line of the matrix: a URL (with the body that exercises it) and, per method it
    answers, the status of a caller who may. Any other method is 405."""

    route: str  # the resolver's name, "namespace:name"
    label: str
    access: object
    methods: dict[str, int]
    url: Callable[[SimpleNamespace], str]
    body: Callable[[SimpleNamespace], dict] = lambda w: {}
    json_body: bool = False
    headers: Callable[[SimpleNamespace], dict] = lambda w: {}
    changes: bool | str = False  # a permitted request changes the world ("session": ends it)
    needs: str = ""  # a run the world must also hold: "unknown" (a step), "late_failure"
    login_page: str = "/login/"  # where an anonymous caller is sent


STEP_OF_ACTION = {
    "retry": "create_task",
    "reconcile": "notify",
    "resolve_happened": "notify",
    "resolve_absent": "notify",
    "override": "create_task",
    "supersede": "decide",
    "decide_again": "decide",
    "stop_agent": "resolve",
    "fork_agent": "resolve:2",
    **dict.fromkeys(("approve_call", "edit_call", "reject_call", "answer_call", "take"), HELD_CALL),
}
CORRECTED = json.dumps({"category": "office", "amount": 120, "approver": "alice"})
HELD_EDIT = json.dumps({"invoice": "inv-1", "amount": 90})  # a held credit note, lowered
HELD_ANSWER = json.dumps({"entry": "posted by hand"})


def action_row(action: str, *, needs: str = "", step: str | None = None, role: Role | None = None) -> Row:
    """A POST of ``action`` on a run in which it is valid (so the permitted POST changes it),
    by the lowest role that may (``role``: where the run asks more than the action's own)."""
    permission = PERMISSION_OF[action]
    run = {
        "": lambda w: w.failed,
        "unknown": lambda w: w.unknown,
        "late_failure": lambda w: w.late,
        "approval": lambda w: w.guarded,
        "refused": lambda w: w.refused,
        "alert": lambda w: w.failed,
        "agent": lambda w: w.agent,
        "versioned": lambda w: w.versioned,
        "moving": lambda w: w.moving,
        "paused": lambda w: w.paused,
        "backoff": lambda w: w.backoff,
        "held": lambda w: w.held,
    }[needs]
    step = STEP_OF_ACTION.get(action, "") if step is None else step
    return Row(
        "console:run-action",
        f"act:{action}{':' + step if step and action == 'compensate' else ''}",
        Console(role or ROLE_OF_ACTION[permission]),
        {"POST": 200},
        url=lambda w: f"/runs/{run(w).workflow_id}/act",
        body=lambda w: {
            "action": action,
            "step": step,
            "reason": "matrix",
            "version": run_version(run(w)),
            "remote_ref": w.remote_message if action == "resolve_happened" else "",
            "request": w.request_id if needs == "approval" else "",
            "decision": {"supersede": CORRECTED, "edit_call": HELD_EDIT, "answer_call": HELD_ANSWER}.get(action, ""),
            "to_version": "2" if action == "move_version" else "",
            **(restart_body(run(w)) if action == "restart" else {}),
        },
        headers=lambda w: {"HX-Request": "true", "HX-Target": "run-body"},
        changes=True,
        needs=needs,
    )


def restart_body(run) -> dict[str, str]:
    """A restart's correction: the order's text with one more amount in it (the model decides again)."""
    return {"edit": "input", "json": json.dumps({**run.input, "text": f"{run.input.get('text', '')} 5"})}


def _role(action: str) -> Role:
    from recovery.permissions import REQUIRED_ROLE

    return REQUIRED_ROLE[action]


ROLE_OF_ACTION = {p: _role(p) for p in set(PERMISSION_OF.values())}

ADMIN_ALL = dict.fromkeys(METHODS, 302)


def admin_row(label: str, url: Callable[[SimpleNamespace], str], **extra) -> Row:
    """Staff only: every caller of the matrix (none is staff) goes to the admin's login page."""
    return Row("admin:*", label, ADMIN, ADMIN_ALL, url=url, login_page="/admin/login/", **extra)


MATRIX: list[Row] = [
    # --- the console ---------------------------------------------------------------------
    Row("console:runs", "runs list", Console(Role.VIEWER), READ, url=lambda w: "/"),
    Row("console:run", "run page", Console(Role.VIEWER), READ, url=lambda w: f"/runs/{w.failed.workflow_id}"),
    Row("console:dashboard", "dashboard", Console(Role.VIEWER), READ, url=lambda w: "/dashboard"),
    Row(
        "console:audit-export",
        "audit export",
        Console(Role.VIEWER),
        {"GET": 200},  # HEAD would run the whole export to send no body
        url=lambda w: "/audit/export?format=jsonl",
    ),
    action_row("resume"),
    action_row("retry"),
    action_row("terminate"),
    # The whole run: its task's compensation names a supervisor; its message's alone, an operator.
    action_row("compensate", needs="late_failure", role=Role.SUPERVISOR),
    action_row("compensate", needs="late_failure", step="notify"),
    action_row("override", needs="refused"),
    action_row("supersede", needs="refused"),
    action_row("decide_again", needs="refused"),
    action_row("reconcile", needs="unknown"),
    action_row("resolve_happened", needs="unknown"),
    action_row("resolve_absent", needs="unknown"),
    action_row("snooze_alert", needs="alert"),  # a supervisor's: the failed run's alert is firing
    action_row("stop_agent", needs="agent"),  # an operator's: a runaway agent is stopped at once
    action_row("fork_agent", needs="agent"),  # a supervisor's: the model is asked again from turn 2
    action_row("move_version", needs="versioned"),  # a supervisor's: a v1 run moved to v2
    action_row("pause", needs="moving"),  # an operator's: a run due now stops before its next step
    action_row("unpause", needs="paused"),
    action_row("retry_now", needs="backoff", step="create_task"),  # an operator's: the backoff dropped
    action_row("reset_attempts", needs="backoff", step="create_task"),  # a supervisor's: the budget back
    action_row("restart", step="create_task"),  # a supervisor's: from the failed step, the order corrected
    Row(
        "console:run-restart",
        "restart page",
        Console(Role.SUPERVISOR),
        {**READ, "POST": 200},  # the form, and what a correction would do (nothing written)
        url=lambda w: f"/runs/{w.failed.workflow_id}/restart",
        body=lambda w: {"stage": "preview", "step": "create_task", **restart_body(w.failed)},
    ),
    Row(
        "console:run-restart",
        "restart, confirmed",
        Console(Role.SUPERVISOR),
        {**READ, "POST": 302},  # back to the run page
        url=lambda w: f"/runs/{w.failed.workflow_id}/restart",
        body=lambda w: {
            "stage": "confirm",
            "step": "create_task",
            "reason": "matrix",
            "version": run_version(w.failed),
            **restart_body(w.failed),
        },
        changes=True,
    ),
    Row(
        "console:run-event",
        "send the event a run waits for",
        Console(Role.OPERATOR),
        {"POST": 302},  # back to the run page
        url=lambda w: f"/runs/{w.waiting.workflow_id}/event",
        body=lambda w: {
            "event": "approved",
            "key": "console:m",
            "payload": '{"approved": true, "amount": 1, "by": "a"}',
        },
        changes=True,
        needs="waiting",
    ),
    Row(
        "api:run-events",
        "event API: the event a run waits for",
        TOKEN,
        {"POST": 201},
        url=lambda w: f"/api/runs/{w.waiting.workflow_id}/events",
        body=lambda w: {"event": "approved", "key": "erp:m", "payload": {"approved": True, "amount": 1, "by": "a"}},
        json_body=True,
        changes=True,
        needs="waiting",
    ),
    # an operator's: a credit note above 100 held for an operator's approval (test_held_calls)
    action_row("approve_call", needs="held"),
    action_row("edit_call", needs="held"),
    action_row("reject_call", needs="held"),
    action_row("answer_call", needs="held"),
    action_row("take", needs="held"),
    Row("console:inbox", "inbox", Console(Role.VIEWER), READ, url=lambda w: "/inbox?role=operator", needs="held"),
    Row(
        "api:run-decisions",
        "decision API: a held call approved for a named operator",
        TOKEN,
        {"POST": 201},
        url=lambda w: f"/api/runs/{w.held.workflow_id}/decisions",
        body=lambda w: {"call": HELD_CALL, "decision": "approve", "reason": "matrix", "as": "matrix-decider"},
        json_body=True,
        changes=True,
        needs="held",
    ),
    Row("api:inbox", "decision API: the inbox", TOKEN, {"GET": 200}, url=lambda w: "/api/inbox", needs="held"),
    action_row("approve", needs="approval"),  # another supervisor's request to terminate
    action_row("reject", needs="approval"),
    Row(
        "console:workflow-pauses",
        "pause a workflow",
        Console(Role.SUPERVISOR),
        {"POST": 302},  # back to the dashboard's pauses
        url=lambda w: "/workflows/pauses",
        body=lambda w: {"action": "pause", "target": "test_orders", "reason": "matrix"},
        changes=True,
    ),
    Row(
        "console:bulk",
        "bulk resume (dry run)",
        Console(Role.OPERATOR),
        {"POST": 200},
        url=lambda w: "/bulk",
        body=lambda w: {"action": "resume", "reason": "matrix", "run": [w.failed.workflow_id]},
    ),
    Row(
        "console:bulk",
        "bulk resume, confirmed",
        Console(Role.OPERATOR),
        {"POST": 200},
        url=lambda w: "/bulk",
        body=lambda w: {"action": "resume", "reason": "matrix", "run": [w.failed.workflow_id], "confirm": "yes"},
        changes=True,
    ),
    Row(
        "console:bulk",
        "bulk terminate, confirmed",
        Console(Role.SUPERVISOR),
        {"POST": 200},
        url=lambda w: "/bulk",
        body=lambda w: {"action": "terminate", "reason": "matrix", "run": [w.failed.workflow_id], "confirm": "yes"},
        changes=True,
    ),
    Row(
        "console:bulk",
        "bulk move to another version, confirmed",
        Console(Role.SUPERVISOR),
        {"POST": 200},
        url=lambda w: "/bulk",
        body=lambda w: {
            "action": "move_version",
            "to_version": "2",
            "reason": "matrix",
            "run": [w.versioned.workflow_id],
            "confirm": "yes",
        },
        changes=True,
        needs="versioned",
    ),
    Row(
        "demo",
        "demo: arm a fault",
        Console(Role.SUPERVISOR),
        {**READ, "POST": 200},
        url=lambda w: "/demo",
        body=lambda w: {"what": "fault", "target": "tasks create", "mode": "forbidden", "times": "2"},
        changes=True,
    ),
    Row(
        "demo",
        "demo: clear",
        Console(Role.SUPERVISOR),
        {**READ, "POST": 200},
        url=lambda w: "/demo",
        body=lambda w: {"what": "clear", "confirm": "yes"},
        changes=True,
    ),
    Row(
        "demo",
        "demo: start an invoice",
        Console(Role.SUPERVISOR),
        {**READ, "POST": 200},
        url=lambda w: "/demo",
        body=lambda w: {"what": "start", "invoice_id": "inv-matrix", "text": "Chairs. Total due EUR 120.00"},
        changes=True,
    ),
    # --- logging in and out ------------------------------------------------------------------
    Row(
        "login",
        "login (a wrong password)",
        PUBLIC,
        {**READ, "POST": 200},
        url=lambda w: "/login/",
        body=lambda w: {"username": "nobody", "password": "wrong"},
        changes=True,  # the failure is counted (recovery.console.login_throttle)
    ),
    Row("logout", "logout", PUBLIC, {"POST": 302}, url=lambda w: "/logout/", changes="session"),
    # --- the event API -------------------------------------------------------------------
    Row(
        "api:events",
        "event API",
        TOKEN,
        {"POST": 201},
        url=lambda w: "/api/events/test_orders",
        body=lambda w: {"tenant": "t", "order_id": "from-api"},
        json_body=True,
        changes=True,
    ),
    Row(
        "api:workflow-pauses",
        "incident API: pauses",
        TOKEN,
        {"GET": 200},
        url=lambda w: "/api/workflows/test_orders/pauses",
    ),
    Row(
        "api:workflow-pause",
        "incident API: pause",
        TOKEN,
        {"POST": 201},
        url=lambda w: "/api/workflows/test_orders/pause",
        body=lambda w: {"step": "post_entry", "reason": "matrix"},
        json_body=True,
        changes=True,
    ),
    Row(
        "api:run-act",
        "incident API: pause a run",
        TOKEN,
        {"POST": 200},
        url=lambda w: f"/api/runs/{w.moving.workflow_id}/pause",
        body=lambda w: {"reason": "matrix"},
        json_body=True,
        changes=True,
        needs="moving",
    ),
    Row(
        "api:workflow-unpause",
        "incident API: unpause",
        TOKEN,
        {"POST": 200},
        url=lambda w: "/api/workflows/test_orders/unpause",
        body=lambda w: {"step": "notify", "reason": "matrix"},
        json_body=True,
        changes=True,
        needs="workflow_paused",
    ),
    # --- a scraper and a container's probes ---------------------------------------------------
    Row("observability:metrics", "metrics", METRICS_TOKEN, READ, url=lambda w: "/metrics"),
    Row("observability:healthz", "liveness", PUBLIC, READ, url=lambda w: "/healthz"),
    Row("observability:readyz", "readiness", PUBLIC, READ, url=lambda w: "/readyz"),
    # --- the simulated systems (their own credential, see sandbox/views.py) ----------------
    Row(
        "sandbox:tasks",
        "tracker: create a task",
        SANDBOX_KEY,
        {"GET": 200, "POST": 201},
        url=lambda w: "/sandbox/tasks/",
        body=lambda w: {"title": "t", "assignee": "alice"},
        json_body=True,
        headers=lambda w: {"Idempotency-Key": "matrix-key"},
        changes=True,
    ),
    Row("sandbox:task", "tracker: one task", SANDBOX_KEY, {"GET": 200}, url=lambda w: f"/sandbox/tasks/{w.task_id}"),
    Row(
        "sandbox:task-cancel",
        "tracker: cancel",
        SANDBOX_KEY,
        {"POST": 200},
        url=lambda w: f"/sandbox/tasks/{w.task_id}/cancel",
        body=lambda w: {"reason": "matrix"},
        json_body=True,
        changes=True,
    ),
    Row(
        "sandbox:task-decide",
        "tracker: approve a task",
        SANDBOX_KEY,
        {"POST": 200},
        url=lambda w: f"/sandbox/tasks/{w.task_id}/decide",
        body=lambda w: {"decision": "approve", "by": "matrix"},
        json_body=True,
        changes=True,
    ),
    Row(
        "sandbox:task-watch",
        "tracker: call back when a task is decided",
        SANDBOX_KEY,
        {"POST": 200},
        url=lambda w: f"/sandbox/tasks/{w.task_id}/watch",
        body=lambda w: {"callback_url": "http://127.0.0.1:9/api/runs/x/events"},
        json_body=True,
        changes=True,
    ),
    Row(
        "sandbox:messages",
        "messenger: send",
        SANDBOX_KEY,
        {"GET": 200, "POST": 201},
        url=lambda w: "/sandbox/messages/",
        body=lambda w: {"to": "alice", "text": "hello"},
        json_body=True,
        changes=True,
    ),
    Row(
        "sandbox:message",
        "messenger: one message",
        SANDBOX_KEY,
        {"GET": 200},
        url=lambda w: f"/sandbox/messages/{w.sandbox_message}",
    ),
    Row(
        "sandbox:message-corrections",
        "messenger: correct",
        SANDBOX_KEY,
        {"POST": 201},
        url=lambda w: f"/sandbox/messages/{w.sandbox_message}/corrections",
        body=lambda w: {"text": "sorry"},
        json_body=True,
        changes=True,
    ),
    Row(
        "sandbox:ledger-entries",
        "ledger: post",
        SANDBOX_KEY,
        {"GET": 200, "POST": 201},
        url=lambda w: "/sandbox/ledger/entries/",
        body=lambda w: {"reference": "matrix-ref", "amount": "1.00", "currency": "EUR", "account": "6000"},
        json_body=True,
        changes=True,
    ),
    Row(
        "sandbox:ledger-entry",
        "ledger: one entry",
        SANDBOX_KEY,
        {"GET": 200},
        url=lambda w: f"/sandbox/ledger/entries/{w.entry_id}",
    ),
    Row(
        "sandbox:ledger-reverse",
        "ledger: reverse",
        SANDBOX_KEY,
        {"POST": 201},
        url=lambda w: f"/sandbox/ledger/entries/{w.entry_id}/reverse",
        body=lambda w: {"reference": "matrix-rev"},
        json_body=True,
        changes=True,
    ),
    # --- Django's admin: staff only, whatever the method (its own login page aside) ----------
    Row("admin:index", "admin index", ADMIN, ADMIN_ALL, url=lambda w: "/admin/", login_page="/admin/login/"),
    admin_row("admin: runs", lambda w: "/admin/recovery/workflowrun/"),
    admin_row("admin: add a run", lambda w: "/admin/recovery/workflowrun/add/", body=lambda w: {"state": "completed"}),
    admin_row(
        "admin: change a run",
        lambda w: f"/admin/recovery/workflowrun/{w.failed.pk}/change/",
        body=lambda w: {"state": "completed"},
    ),
    admin_row(
        "admin: delete a run",
        lambda w: f"/admin/recovery/workflowrun/{w.failed.pk}/delete/",
        body=lambda w: {"post": "yes"},
    ),
    admin_row(
        "admin: add a user",
        lambda w: "/admin/auth/user/add/",
        body=lambda w: {"username": "mallory", "password1": "x-Long-pass-1", "password2": "x-Long-pass-1"},
    ),
    admin_row(
        "admin: a user's groups",
        lambda w: f"/admin/auth/user/{w.bystander}/change/",
        body=lambda w: {"groups": [w.supervisor_group]},
    ),
    admin_row("admin: faults", lambda w: "/admin/sandbox/fault/", body=lambda w: {"action": "delete_selected"}),
    # The admin's own logout sends a non-staff caller to the admin's index (which then asks to log in).
    Row("admin:*", "admin: log out", ADMIN, ADMIN_ALL, url=lambda w: "/admin/logout/", login_page="/admin/"),
]


def expected(row: Row, method: str, caller: str) -> tuple[int, str | None]:
    """(status, where a redirect must lead) for ``caller`` sending ``method`` to ``row``."""
    if method not in row.methods:
        return 405, None
    ok = row.methods[method]
    match row.access:
        case Console(role=role):
            if caller not in ROLE_OF_CALLER:
                return 302, row.login_page
            return (ok, None) if ROLE_OF_CALLER[caller] >= role else (403, None)
        case "public":
            return ok, ("/login/" if ok == 302 else None)
        case "token" | "sandbox-key" | "metrics-token":
            return (ok, None) if caller == "credential" else (401, None)
        case "admin":
            return 302, row.login_page
    raise AssertionError(f"unknown access {row.access!r}")


# --- the world a request may change -----------------------------------------------------


def world_state() -> dict:
    """Everything a refused request must leave as it was."""
    return {
        "runs": list(WorkflowRun.objects.order_by("pk").values_list("pk", "state", "current_step", "updated_at")),
        "steps": list(StepExecution.objects.order_by("pk").values_list("pk", "state", "attempts", "remote_ref")),
        "audit": AuditEvent.objects.count(),
        "outbox": list(OutboxMessage.objects.order_by("pk").values_list("pk", "state", "attempts")),
        "decisions": ModelDecision.objects.count(),
        "approvals": list(ApprovalRequest.objects.order_by("pk").values_list("pk", "state", "decided_by")),
        "tokens": list(ApiToken.objects.order_by("pk").values_list("pk", "revoked_at", "last_used_at")),
        "alerts": list(Alert.objects.order_by("pk").values_list("pk", "state", "snoozed_until")),
        "users": list(get_user_model().objects.order_by("pk").values_list("pk", "username", "is_staff")),
        "memberships": list(get_user_model().groups.through.objects.order_by("pk").values_list("pk")),
        "groups": Group.objects.count(),
        "sessions": sorted(Session.objects.values_list("session_key", flat=True)),
        "login_failures": LoginFailure.objects.count(),
        "tasks": list(Task.objects.using("sandbox").order_by("pk").values_list("pk", "status", "callback_url")),
        "messages": Message.objects.using("sandbox").count(),
        "ledger": LedgerEntry.objects.using("sandbox").count(),
        "faults": list(Fault.objects.using("sandbox").order_by("pk").values_list("pk", "remaining")),
        "idempotency": IdempotencyRecord.objects.using("sandbox").count(),
        "workflow_pauses": list(WorkflowPause.objects.order_by("pk").values_list("pk", "released_at")),
        "run_events": RunEvent.objects.count(),
    }


def make_world(clock, monkeypatch, *, needs: str) -> SimpleNamespace:
    """A failed run (and, if asked, one with an unknown step), a task, a message, a ledger entry
    and an armed fault in the sandbox, an API token, a user without a role."""
    w = SimpleNamespace()
    w.failed = failed_run(clock)
    w.unknown = unknown_run(clock, monkeypatch) if needs == "unknown" else None
    if needs == "alert":
        w.failed.refresh_from_db()
        alert_raise(run_pk=w.failed.pk, cause="failed_with_effects", revision=w.failed.revision, why="x", channels=[])
    if needs == "late_failure":  # the task and the message exist, the ledger refused: compensable
        receivers.arm("ledger", "forbidden")
        w.late = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "late"})[0], clock)
    if needs == "agent":  # an agent's credit note failed once (503): the run waits in turn 2
        receivers.arm("ledger", "unavailable")
        w.agent = run_start(workflow="test_agent", data={"tenant": "t", "order_id": "agent"})[0]
        advance(w.agent.pk)
        w.agent.refresh_from_db()
    if needs == "versioned":  # a run started on the older of two registered versions
        w.versioned = run_start(workflow=get_workflow("test_versioned", 1), data={"tenant": "t", "order_id": "v1"})[0]
    if needs in ("moving", "paused"):  # a run due now, that moves by itself (paused, if asked)
        w.moving = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "moving"})[0]
        if needs == "paused":
            w.paused = run_pause(workflow_id=w.moving.workflow_id, actor=None, reason="matrix")
    if needs == "backoff":  # create_task failed once (503): the run waits for its retry
        receivers.arm("task", "unavailable")
        w.backoff = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "backoff"})[0]
        advance(w.backoff.pk)
        w.backoff.refresh_from_db()
    if needs == "refused":  # a guard refused the model's approver before anything was written
        receivers.MODEL_SCRIPT.append(json.dumps({"category": "office", "amount": 120, "approver": "mallory"}))
        w.refused = drive(run_start(workflow="test_policy", data={"tenant": "t", "order_id": "refused"})[0], clock)
    if needs == "approval":  # a four-eyes run, and another supervisor's request to terminate it
        receivers.arm("task", "forbidden")
        w.guarded = drive(run_start(workflow="test_guarded", data={"tenant": "t", "order_id": "4eyes"})[0], clock)
        requester = get_user_model().objects.create_user("requester", password="pw")
        requester.groups.add(Group.objects.get_or_create(name="supervisor")[0])
        w.request_id = approval_request(
            workflow_id=w.guarded.workflow_id, action="terminate", actor=requester, reason="matrix"
        ).pk
        w.guarded.refresh_from_db()
    if needs == "unknown":
        from tests.support.models import RemoteObject
        from tests.support.workflows import notify

        w.remote_message = f"msg-{RemoteObject.objects.get(kind='message').pk}"
        # Its in-flight window has closed: "it did not happen" is then an operator's to say.
        clock.set(w.unknown.steps.get(step_name="notify").last_attempt_at + notify.in_flight_bound())
    w.task_id = sandbox_services.create_task(key="k-0", title="t", assignee="a", payload={}).body["id"]
    w.sandbox_message = sandbox_services.send_message(to="a", text="hi", client_ref="c-0").body["id"]
    entry = sandbox_services.post_entry(
        reference="r-0", amount=Decimal("5.00"), currency="EUR", account="6000", memo=""
    )
    w.entry_id = entry.body["id"]
    faults.set_fault("ledger", "post", "slow", times=1, delay_ms=1)
    w.supervisor_group = Group.objects.get_or_create(name="supervisor")[0].pk
    w.bystander = get_user_model().objects.create_user("bystander", password="pw").pk
    # the event's sender, for a waiting run; the chat bot deciding for a person, for a held call
    token_for = {"waiting": "test_approvals", "held": "test_held_calls"}.get(needs, "test_orders")
    w.token = tokens.issue_token(name="erp", workflow_name=token_for, may_pause=True, may_decide=needs == "held")[1]
    if needs == "waiting":  # a run waiting for its approver's event (a durable wait)
        w.waiting = drive(run_start(workflow="test_approvals", data={"tenant": "t", "order_id": "waits"})[0], clock)
    if needs == "held":  # a credit note of 120 waits for an operator's approval; the bot decides for one
        w.held = drive(run_start(workflow="test_held_calls", data={"tenant": "t", "order_id": "held"})[0], clock)
        decider = get_user_model().objects.create_user("matrix-decider", password="pw")
        decider.groups.add(Group.objects.get_or_create(name="operator")[0])
    if needs == "workflow_paused":  # a supervisor paused a step of the workflow: it can be released
        workflow_pause(workflow="test_orders", step_name="notify", actor="matrix", reason="matrix")
    sweeper_beat(name="matrix")  # so that /readyz answers ready
    return w


def client_for(caller: str, row: Row, w: SimpleNamespace, **options) -> Client:
    if caller == "credential":
        secret = {SANDBOX_KEY: settings.SANDBOX_API_KEY, METRICS_TOKEN: settings.RECOVERY_METRICS_TOKEN}.get(
            row.access, w.token
        )
        return Client(headers={"Authorization": f"Bearer {secret}"}, **options)
    client = Client(**options)
    if caller != "anonymous":
        user = get_user_model().objects.create_user(f"matrix-{caller}", password="pw")
        user.groups.add(Group.objects.get_or_create(name=caller)[0])
        client.force_login(user)
    return client


def send(client: Client, row: Row, w: SimpleNamespace, method: str):
    url, body = row.url(w), row.body(w)
    if row.json_body:
        data, content_type = json.dumps(body), "application/json"
    else:
        data, content_type = urlencode(body, doseq=True), "application/x-www-form-urlencoded"
    if method in ("GET", "HEAD") and body and not row.json_body:
        url, data = f"{url}{'&' if '?' in url else '?'}{data}", ""
    response = client.generic(method, url, data, content_type=content_type, headers=row.headers(w))
    if response.streaming:
        b"".join(response.streaming_content)
    response.requested = url  # what a login redirect must lead back to
    return response


def _check(response, want: tuple[int, str | None]) -> str | None:
    status, location = want
    if response.status_code != status:
        return f"got {response.status_code}, expected {status}"
    if location is None:
        return None
    where = urlsplit(response["Location"])
    if where.path != location:
        return f"redirected to {response['Location']}, expected {location}"
    if location.endswith("login/") and response.requested != "/logout/":
        back = parse_qs(where.query).get("next", [""])[0]
        if back != response.requested:
            return f"login redirect's next is {back!r}, expected {response.requested!r}"
    return None


def _id(row: Row) -> str:
    return row.label.replace(" ", "-")


def _permitted_write(row: Row, method: str, caller: str) -> bool:
    want, login = expected(row, method, caller)
    refused = isinstance(row.access, Console) and login is not None  # a console page's caller sent to log in
    return (
        bool(row.changes)
        and method == "POST"
        and row.access != ADMIN
        and want == row.methods.get(method)
        and not refused
    )


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("row", MATRIX, ids=_id)
def test_every_url_method_and_caller_gets_its_answer_and_a_refusal_changes_nothing(row, caller, clock, monkeypatch):
    """Each refused request (302 to a login page, 401, 403, 405) and each permitted read leaves
    every run, step, audit event, outbox row, token, user, session, sandbox row and fault as it
    was; a permitted write answers its status and does change the world, so the refusals
    before it were refusing something that would have happened."""
    w = make_world(clock, monkeypatch, needs=row.needs)
    client = client_for(caller, row, w)
    problems: list[str] = []
    writes = [m for m in METHODS if _permitted_write(row, m, caller)]
    for method in [m for m in METHODS if m not in writes]:
        before = world_state()
        response = send(client, row, w, method)
        if problem := _check(response, expected(row, method, caller)):
            problems.append(f"{method} as {caller}: {problem}")
        after = world_state()
        if row.access == TOKEN and response.status_code == row.methods.get(method):
            # A token's permitted read records when the token was used, and nothing else.
            for world in (before, after):
                world["tokens"] = [(pk, revoked) for pk, revoked, _ in world["tokens"]]
        if after != before:
            problems.append(f"{method} as {caller} answered {response.status_code} but changed the world")
    for method in writes:  # last: every request above met an unchanged world
        before = world_state()
        response = send(client, row, w, method)
        if problem := _check(response, expected(row, method, caller)):
            problems.append(f"{method} as {caller}: {problem} {response.content[:300]!r}")
        must_change = row.changes is True or caller in ROLE_OF_CALLER  # "session": a logged-in caller's
        if must_change and world_state() == before:
            problems.append(f"{method} as {caller} answered {response.status_code} but changed nothing")
    assert problems == [], f"{row.label}:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "row", [r for r in MATRIX if "POST" in r.methods and (r.access == PUBLIC or isinstance(r.access, Console))], ids=_id
)
def test_every_console_form_needs_the_csrf_token(row, clock, monkeypatch):
    """A supervisor's browser made to post from another site (no CSRF token) is refused with 403
    and nothing changes, on every form the console and the login page accept."""
    w = make_world(clock, monkeypatch, needs=row.needs)
    client = client_for("supervisor", row, w, enforce_csrf_checks=True)
    before = world_state()
    assert send(client, row, w, "POST").status_code == 403
    assert world_state() == before


def test_the_admin_is_read_only_even_for_a_superuser(clock, monkeypatch):
    """A superuser reaches the admin, but it refuses every add, change and delete of the engine's
    and the sandbox's rows (state changes go through recovery.engine.transitions only)."""
    w = make_world(clock, monkeypatch, needs="")
    admin = get_user_model().objects.create_superuser("root", password="pw")
    client = Client()
    client.force_login(admin)
    assert client.get("/admin/recovery/workflowrun/").status_code == 200
    before = world_state()
    for url, body in [
        ("/admin/recovery/workflowrun/add/", {"workflow_id": "forged", "state": "completed"}),
        (f"/admin/recovery/workflowrun/{w.failed.pk}/change/", {"state": "completed"}),
        (f"/admin/recovery/workflowrun/{w.failed.pk}/delete/", {"post": "yes"}),
        ("/admin/recovery/auditevent/add/", {"action": "forged"}),
        ("/admin/sandbox/fault/add/", {"service": "tasks", "operation": "create", "mode": "forbidden"}),
    ]:
        assert client.post(url, body).status_code == 403, url
    assert world_state() == before


# --- the matrix covers every URL --------------------------------------------------------


def resolver_routes(resolver: URLResolver | None = None, namespace: str = "") -> list[tuple[str, str | None]]:
    """(name with namespace, route) of every URL pattern the project serves."""
    resolver = resolver or get_resolver()
    routes = []
    for pattern in resolver.url_patterns:
        if isinstance(pattern, URLResolver):
            inner = f"{namespace}{pattern.namespace}:" if pattern.namespace else namespace
            routes += [(name, f"{pattern.pattern}{route}") for name, route in resolver_routes(pattern, inner)]
        elif isinstance(pattern, URLPattern):
            # an unnamed pattern inside a namespace (the admin's redirects) goes by the namespace
            name = f"{namespace}{pattern.name}" if pattern.name else namespace or None
            routes.append((name, str(pattern.pattern)))
    return routes


def test_every_url_is_in_the_matrix():
    """A URL added without a line in MATRIX fails here: decide who may call it, and how. The
    admin's many URLs share its lines ("admin:*"): all of them are for staff only."""
    covered = {row.route for row in MATRIX}
    served = resolver_routes()
    assert [route for name, route in served if name is None] == [], "a URL needs a name to be in the matrix"
    missing = [(name, route) for name, route in served if name not in covered and not name.startswith("admin:")]
    assert missing == []
    assert covered - {name for name, _ in served} == {"admin:*"}, "a line for a URL that no longer exists"


def test_every_console_action_is_in_the_matrix():
    """Each action value the run page accepts (PERMISSION_OF) has its own line."""
    rows = {row.label.split(":")[1] for row in MATRIX if row.route == "console:run-action"}
    assert rows == set(PERMISSION_OF)
