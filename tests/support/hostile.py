"""Hostile text planted in every field the console shows (docs/recovery-contract.md: operators read model output,
invoice text and remote errors that nobody here wrote). Used by tests/console/test_hostile_input.py
(the raw HTML) and tests/browser/test_hostile_browser.py (a real browser).

Each planted value is one of PAYLOADS followed by the name of its field, so that a test can
tell every field apart and fail when one is not rendered at all."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.utils import timezone
from django.utils.html import escape

from recovery.engine.transitions import run_start, run_terminate, step_resolve
from recovery.models import DecisionState, ModelDecision, OutboxMessage, StepExecution, WorkflowRun
from tests.support import receivers, workflows

SCRIPT = "<script>window.__xss=1</script>"
IMG = '"><img src=x onerror="window.__xss=1">'
ATTR = "' onmouseover='window.__xss=1' x='"
SVG = "</textarea><svg onload=window.__xss=1>"
JS_URL = "javascript:window.__xss=1"
PAYLOADS = (SCRIPT, IMG, ATTR, SVG, JS_URL)
# Everything at once, for the fields that are shown whole (no truncation below 150 characters).
ALL = SCRIPT + IMG + ATTR + SVG


def tagged(payload: str, name: str) -> str:
    return f"{payload} [{name}]"


@dataclass
class Planted:
    """What was planted: the runs and, per page, the values that page must show as text."""

    resolved: WorkflowRun  # unknown outcome settled by a hostile-named operator, then terminated
    hostile_id: WorkflowRun  # a failed run whose workflow id (and business key) is ALL
    actor: str  # the hostile operator's username
    on_run_page: dict[str, str] = field(default_factory=dict)  # field -> value, on resolved's page
    on_list_page: dict[str, str] = field(default_factory=dict)


def plant(clock, monkeypatch) -> Planted:
    from tests.support.engine import drive

    actor = tagged(IMG, "actor")[:150]
    user = get_user_model().objects.create_user(actor, password="pw")
    user.groups.add(Group.objects.get_or_create(name="supervisor")[0])

    # Model output through the real decision step: one invalid answer kept for diagnosis, then
    # an accepted proposal whose approver is hostile (it flows into the next step's intent).
    invalid = f'{{"category": {_json(tagged(ALL, "invalid_output"))}, "amount": 1, "approver": "x"}}'
    approver = tagged(SCRIPT, "approver")  # shown in a pprint of the decision: short, no quote
    receivers.MODEL_SCRIPT.extend([invalid, f'{{"category": "office", "amount": 1, "approver": {_json(approver)}}}'])
    # Invoice text (the run's input) is shown in the steps' intents.
    text = tagged(SVG, "input_text")
    # notify's outcome becomes unknown (committed, answer lost, lookup down): an operator
    # settles it with evidence.
    receivers.arm("message", "commit_then_drop")
    monkeypatch.setattr(workflows.notify, "lookup_fn", lambda ctx: (_ for _ in ()).throw(RuntimeError("down")))
    run = drive(
        run_start(workflow="test_orders", data={"tenant": "t", "order_id": "hostile-1", "text": text})[0], clock
    )
    monkeypatch.undo()
    remote_ref = tagged(JS_URL, "remote_ref")
    resolve_reason = tagged(ALL, "audit_reason")
    step_resolve(
        workflow_id=run.workflow_id,
        step_name="notify",
        actor=user,
        reason=resolve_reason,
        happened=True,
        # what a receiver answered (its own reference, whatever it holds), as evidence.examine returns it
        evidence={"remote_ref": remote_ref, "result": {"message_id": remote_ref}, "checked": "looked up"},
    )
    status_reason = tagged(IMG + ATTR, "status_reason")
    run_terminate(workflow_id=run.workflow_id, actor=user, reason=status_reason)

    # Only a remote system (or a crash) writes these: rows as the transitions would leave them.
    last_error = tagged(ALL, "last_error")  # on a step that has not succeeded: its error is shown
    StepExecution.objects.filter(run=run, step_name="post_entry").update(
        last_error_kind="permanent", last_error=last_error
    )
    compensation_ref = tagged(SVG + JS_URL, "compensation_ref")
    StepExecution.objects.filter(run=run, step_name="notify").update(compensation_ref=compensation_ref)
    incident = tagged(ALL, "incident") + "\nsecond line " + SCRIPT
    WorkflowRun.objects.filter(pk=run.pk).update(incident=incident)
    superseded_reason = tagged(ALL, "superseded_reason")
    ModelDecision.objects.create(
        run=run,
        step_name="decide",
        version=99,
        schema_version=1,
        state=DecisionState.SUPERSEDED,
        proposal={"approver": tagged(ALL, "superseded_proposal")},
        accepted={"approver": tagged(ALL, "superseded_proposal")},
        superseded_reason=superseded_reason,
        created_at=timezone.now(),
    )
    outbox_error = tagged(IMG + SVG, "outbox_error")
    provider_ref = tagged(ATTR + JS_URL, "provider_ref")
    now = timezone.now()
    OutboxMessage.objects.create(
        run=run,
        step_name="notify",
        idempotency_key="hostile-outbox-key",
        payload={"text": SCRIPT},
        state="failed",
        provider_ref=provider_ref,
        last_error_kind="permanent",
        last_error=outbox_error,
        created_at=now,
        updated_at=now,
    )
    run.refresh_from_db()

    # A failed run whose workflow id is the hostile text: shown in the list, its page, the
    # action forms' URLs, the bulk checkboxes' values and labels.
    receivers.arm("task", "forbidden")
    hostile = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": ALL})[0], clock)

    return Planted(
        resolved=run,
        hostile_id=hostile,
        actor=actor,
        on_run_page={
            "actor": actor,
            "input_text": _json(text),  # in the steps' intents, as JSON
            "approver": _json(approver),
            "invalid_output": invalid,
            "remote_ref": remote_ref,
            "audit_reason": resolve_reason,
            "status_reason": status_reason,
            "last_error": last_error,
            "compensation_ref": compensation_ref,
            "incident": tagged(ALL, "incident"),
            "superseded_reason": superseded_reason,
            "outbox_error": outbox_error,
            "provider_ref": provider_ref,
        },
        on_list_page={"status_reason": status_reason, "workflow_id": hostile.workflow_id},
    )


def _json(text: str) -> str:
    """A string as the console prints JSON (the pretty_json filter: non-ASCII kept)."""
    import json

    return json.dumps(text, ensure_ascii=False)


def assert_escaped(html: str, values: dict[str, str] | list[str]) -> None:
    """Each value appears in its escaped form, and no payload appears raw."""
    for name, value in values.items() if isinstance(values, dict) else enumerate(values):
        assert escape(value) in html, f"{name}: {value!r} is not shown (escaped) on the page"
    for payload in PAYLOADS[:-1]:  # JS_URL has nothing to escape: see assert_no_script_url
        assert payload not in html, f"raw {payload!r} in the page"
    assert_no_script_url(html)


def assert_no_script_url(html: str) -> None:
    lowered = html.lower()
    for attribute in ("href=", "src=", "action=", "formaction=", "hx-get=", "hx-post="):
        for quote in ('"', "'", ""):
            assert f"{attribute}{quote}javascript:" not in lowered, f"a javascript: URL in {attribute}"
