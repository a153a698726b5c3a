"""Four-eyes (issue 7): on a workflow whose contract sets ``four_eyes``, compensate, terminate
and "mark succeeded" run only once a second supervisor approves a request for them. The
request and the approval are separate audit events by different users; nobody approves their
own request — not in the transitions, not in the console, not in the database."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import IntegrityError, transaction
from django.test import Client
from django.urls import reverse

from recovery.console import services
from recovery.engine import evidence
from recovery.engine.audit import chain as audit_chain
from recovery.engine.transitions import (
    approval_grant,
    approval_reject,
    approval_request,
    perform,
    run_compensate,
    run_start,
    run_terminate,
    run_version,
    step_resolve,
)
from recovery.errors import ApprovalRequired, InvalidTransition
from recovery.models import ApprovalRequest, ApprovalState, AuditEvent, RunState, StepState, WorkflowRun
from recovery.workflow import Workflow
from tests.support import receivers, workflows
from tests.support.console import failed_run, unknown_run
from tests.support.engine import drive
from tests.support.models import RemoteObject

pytestmark = pytest.mark.django_db


def person(name: str, role: str | None):
    user = get_user_model().objects.create_user(name, password="pw")
    if role:
        user.groups.add(Group.objects.get_or_create(name=role)[0])
    return user


@pytest.fixture
def people():
    return {
        "alice": person("alice", "supervisor"),
        "bob": person("bob", "supervisor"),
        "olga": person("olga", "operator"),
        "vera": person("vera", "viewer"),
    }


def guarded_failed(clock, order_id="g-1") -> WorkflowRun:
    """Failed at create_task: nothing to compensate yet; terminable."""
    return failed_run(clock, order_id, workflow="test_guarded")


def guarded_late(clock) -> WorkflowRun:
    """The task and the message exist, the ledger refused: compensable."""
    receivers.arm("ledger", "forbidden")
    return drive(run_start(workflow="test_guarded", data={"tenant": "t", "order_id": "late"})[0], clock)


def guarded_unknown(clock, monkeypatch) -> WorkflowRun:
    return unknown_run(clock, monkeypatch, "unknown", workflow="test_guarded")


def trail(run: WorkflowRun) -> list[tuple[str, str, str]]:
    return list(run.audit_events.order_by("id").values_list("action", "actor", "reason"))


def frozen(run: WorkflowRun) -> tuple:
    run.refresh_from_db()
    steps = list(run.steps.order_by("position").values_list("state", "remote_ref"))
    return run.state, run.updated_at, steps, run.audit_events.count(), receivers.counts()


def test_the_contract_names_the_actions_that_need_a_second_supervisor():
    assert workflows.guarded.four_eyes == {"compensate", "terminate", "resolve_happened", "move_version", "restart"}
    assert workflows.orders.four_eyes == frozenset()
    with pytest.raises(ValueError, match="resume cannot need approval"):
        Workflow("bad_four_eyes", version=1, workflow_id=lambda i: "x", four_eyes=["terminate", "resume"])


def test_terminate_waits_for_another_supervisor_then_runs_with_both_names_in_the_trail(clock, people):
    run = guarded_failed(clock)
    assert run.state == RunState.FAILED
    alice, bob = people["alice"], people["bob"]
    before = frozen(run)

    with pytest.raises(ApprovalRequired, match="needs a second supervisor's approval"):
        run_terminate(workflow_id=run.workflow_id, actor=alice, reason="customer cancelled")
    assert frozen(run) == before

    why = "customer cancelled"
    request = approval_request(workflow_id=run.workflow_id, action="terminate", actor=alice, reason=why)
    assert request.state == ApprovalState.PENDING
    run.refresh_from_db()
    assert run.state == RunState.FAILED  # nothing happens until someone else approves
    assert trail(run)[-1] == ("approval_request", "alice", "customer cancelled")

    with pytest.raises(InvalidTransition, match="cannot approve your own request"):
        approval_grant(request_id=request.pk, actor=alice, reason="looks right")
    for someone in (people["olga"], people["vera"]):
        with pytest.raises(InvalidTransition, match="only a supervisor can approve"):
            approval_grant(request_id=request.pk, actor=someone, reason="looks right")
    request.refresh_from_db()
    assert request.state == ApprovalState.PENDING and len(trail(run)) == before[3] + 1

    approval_grant(request_id=request.pk, actor=bob, reason="confirmed with finance")

    run.refresh_from_db()
    request.refresh_from_db()
    assert run.state == RunState.TERMINATED
    assert (request.state, request.decided_by, request.requested_by) == (ApprovalState.APPROVED, bob, alice)
    assert trail(run)[-3:] == [
        ("approval_request", "alice", "customer cancelled"),
        ("approval_grant", "bob", "confirmed with finance"),
        ("terminate", "bob", "customer cancelled (requested by alice, approved by bob)"),
    ]
    grant = run.audit_events.get(action="approval_grant")
    assert grant.after["approval"] == {"id": request.pk, "action": "terminate", "state": "approved",
                                       "requested_by": "alice"}  # fmt: skip
    with pytest.raises(InvalidTransition, match="already approved"):
        approval_grant(request_id=request.pk, actor=people["bob"], reason="looks right")
    assert audit_chain.verify(audit_chain.stored_chains()).first is None


def test_the_database_refuses_an_approval_by_the_requester(clock, people):
    run = guarded_failed(clock)
    request = approval_request(workflow_id=run.workflow_id, action="terminate", actor=people["alice"], reason="r")
    with pytest.raises(IntegrityError), transaction.atomic():
        ApprovalRequest.objects.filter(pk=request.pk).update(state=ApprovalState.APPROVED, decided_by=people["alice"])
    request.refresh_from_db()
    assert request.state == ApprovalState.PENDING


def test_a_request_is_only_made_for_an_action_that_would_run_now(clock, people):
    run = guarded_failed(clock)  # failed before any compensable step completed
    before = frozen(run)
    with pytest.raises(InvalidTransition, match="no completed step with a compensation"):
        approval_request(workflow_id=run.workflow_id, action="compensate", actor=people["alice"], reason="undo")
    with pytest.raises(InvalidTransition, match="is not waiting for reconciliation"):
        evidence.examine(
            "resolve_happened",
            workflow_id=run.workflow_id,
            step_name="create_task",
            remote_ref="task-1",
            actor=people["alice"],
        )
    plain = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "plain"})[0], clock)
    with pytest.raises(InvalidTransition, match="needs no approval on test_orders runs"):
        approval_request(workflow_id=plain.workflow_id, action="terminate", actor=people["alice"], reason="r")
    assert frozen(run)[:4] == before[:4] and not ApprovalRequest.objects.exists()

    approval_request(workflow_id=run.workflow_id, action="terminate", actor=people["alice"], reason="r")
    with pytest.raises(InvalidTransition, match="already waiting for approval"):
        approval_request(workflow_id=run.workflow_id, action="terminate", actor=people["bob"], reason="me too")
    assert ApprovalRequest.objects.count() == 1


def test_a_rejected_request_changes_nothing_and_cannot_be_approved_later(clock, people):
    run = guarded_failed(clock)
    request = approval_request(workflow_id=run.workflow_id, action="terminate", actor=people["alice"], reason="r")
    before = frozen(run)
    with pytest.raises(InvalidTransition, match="a reason is required"):
        approval_reject(request_id=request.pk, actor=people["bob"], reason=" ")
    with pytest.raises(InvalidTransition, match="only a supervisor, or the requester"):
        approval_reject(request_id=request.pk, actor=people["olga"], reason="no")

    approval_reject(request_id=request.pk, actor=people["bob"], reason="not without the customer's letter")

    state, updated, steps, events, effects = frozen(run)
    assert (state, updated, steps, effects) == (before[0], before[1], before[2], before[4])
    assert events == before[3] + 1 and trail(run)[-1] == ("approval_reject", "bob", "not without the customer's letter")
    with pytest.raises(InvalidTransition, match="already rejected"):
        approval_grant(request_id=request.pk, actor=people["bob"], reason="looks right")
    assert WorkflowRun.objects.get(pk=run.pk).state == RunState.FAILED


def test_compensation_after_approval_undoes_every_completed_effect(clock, people):
    run = guarded_late(clock)
    assert run.state == RunState.FAILED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 0, "model_call": 1}
    with pytest.raises(ApprovalRequired):
        run_compensate(workflow_id=run.workflow_id, actor=people["alice"], reason="undo")
    request = approval_request(workflow_id=run.workflow_id, action="compensate", actor=people["alice"], reason="undo")
    assert not any(s == StepState.COMPENSATING for s in run.steps.values_list("state", flat=True))

    approval_grant(request_id=request.pk, actor=people["bob"], reason="looks right")
    run = drive(run, clock)

    assert run.state == RunState.COMPENSATED
    assert set(run.steps.filter(step_name__in=["create_task", "notify"]).values_list("state", flat=True)) == {
        StepState.COMPENSATED
    }
    assert receivers.compensations() == {"task_cancel": 1, "correction": 1, "reversal": 0}


def test_mark_succeeded_needs_approval_but_it_did_not_happen_does_not(clock, monkeypatch, people):
    run = guarded_unknown(clock, monkeypatch)
    step = run.steps.get(step_name="notify")
    assert step.state == StepState.UNKNOWN
    ref = f"msg-{RemoteObject.objects.get(kind='message').pk}"
    common = {"workflow_id": run.workflow_id, "step_name": "notify", "reason": "seen in the messenger"}
    checked = evidence.examine(
        "resolve_happened", workflow_id=run.workflow_id, step_name="notify", remote_ref=ref, actor=people["olga"]
    )
    with pytest.raises(ApprovalRequired):
        step_resolve(**common, actor=people["olga"], happened=True, evidence=checked)
    request = approval_request(**common, action="resolve_happened", evidence=checked, actor=people["olga"])

    approval_grant(request_id=request.pk, actor=people["alice"], reason="looks right")

    step.refresh_from_db()
    assert (step.state, step.remote_ref) == (StepState.SUCCEEDED, ref)
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and receivers.counts()["message"] == 1


def test_bulk_terminate_never_bypasses_four_eyes(clock, people):
    guarded = guarded_failed(clock, "bulk-g")
    receivers.arm("task", "forbidden")
    plain = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "bulk-p"})[0], clock)
    assert plain.state == RunState.FAILED
    ids = [guarded.workflow_id, plain.workflow_id]
    bulk = services.BulkRequest(action="terminate", reason="clean up", workflow_ids=ids)
    preview = services.bulk_preview(bulk, actor=people["alice"])
    assert preview.done == [plain.workflow_id]  # the dry run says so before anything is tried
    assert [w for w, _ in preview.refused] == [guarded.workflow_id] and "second supervisor" in preview.refused[0][1]
    # Even confirmed with both (a forged confirmation), the guarded run is refused.
    result = services.bulk_apply(bulk, actor=people["alice"])
    assert result.done == [plain.workflow_id]
    assert [w for w, _ in result.refused] == [guarded.workflow_id] and "second supervisor" in result.refused[0][1]
    assert WorkflowRun.objects.get(pk=guarded.pk).state == RunState.FAILED


# --- the console --------------------------------------------------------------------------


def client_of(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def act(client: Client, run: WorkflowRun, action: str, **data):
    run.refresh_from_db()
    body = {"action": action, "reason": "from the console", "version": run_version(run), **data}
    headers = {"HX-Request": "true", "HX-Target": "run-body"}
    return client.post(reverse("console:run-action", args=[run.workflow_id]), body, headers=headers)


def test_in_the_console_one_supervisor_requests_and_another_approves(clock, people):
    run = guarded_failed(clock)
    alice, bob = client_of(people["alice"]), client_of(people["bob"])
    page = alice.get(reverse("console:run", args=[run.workflow_id])).text
    assert "Request: Terminate" in page and "A second supervisor must approve it" in page

    response = act(alice, run, "terminate")
    assert response.status_code == 200 and "terminate requested: another supervisor must approve it" in response.text
    request = ApprovalRequest.objects.get()
    assert 'data-action="approve:' not in response.text and "Your request" in response.text
    assert WorkflowRun.objects.get(pk=run.pk).state == RunState.FAILED

    response = act(alice, run, "approve", request=str(request.pk))
    assert response.status_code == 400 and "cannot approve your own request" in response.text
    operator = act(client_of(people["olga"]), run, "approve", request=str(request.pk))
    assert operator.status_code == 403
    assert ApprovalRequest.objects.get().state == ApprovalState.PENDING
    for bad in ("", "x", "99999999", "1" * 40):
        assert act(bob, run, "approve", request=bad).status_code == 400

    page = bob.get(reverse("console:run", args=[run.workflow_id])).text
    assert "Waiting for a second supervisor" in page and f'data-action="approve:{request.pk}"' in page
    response = act(bob, run, "approve", request=str(request.pk))

    assert response.status_code == 200 and "terminate approved and recorded; the run is now terminated" in response.text
    assert WorkflowRun.objects.get(pk=run.pk).state == RunState.TERMINATED
    assert [a for a, *_ in trail(run)][-3:] == ["approval_request", "approval_grant", "terminate"]
    assert AuditEvent.objects.filter(action="approval_grant", actor_user=people["bob"]).count() == 1


def test_a_restart_waits_for_another_supervisor_then_runs_with_the_correction_it_was_asked_with(clock, people):
    """The request carries the correction and its difference; the grant performs exactly it."""
    run = drive(run_start(workflow="test_guarded", data={"tenant": "t", "order_id": "fix", "text": "120"})[0], clock)
    assert run.state == RunState.COMPLETED
    corrected = ("intent", {"amount": 125})
    with pytest.raises(ApprovalRequired):  # not directly: the workflow puts restarts behind four eyes
        perform(
            "restart",
            workflow_id=run.workflow_id,
            step_name="post_entry",
            actor=people["alice"],
            reason="amount misread",
            correction=corrected,
        )
    said = services.apply_action(
        action="restart",
        workflow_id=run.workflow_id,
        step="post_entry",
        reason="amount misread",
        expect=None,
        remote_ref="",
        correction=("intent", '{"amount": 125}'),
        actor=people["alice"],
    )
    assert (
        said
        == "restart from a step with a corrected input requested: another supervisor must approve it before it runs"
    )
    request = ApprovalRequest.objects.get(run=run, action="restart")
    assert request.options == {"correction": ["intent", {"amount": 125}], "effects_stand": False}
    asked = AuditEvent.objects.get(run=run, action="approval_request")
    assert asked.after["approval"]["correction"] == ["intent", {"amount": 125}]
    assert receivers.counts()["ledger"] == 1  # nothing done yet
    bob = Client()
    bob.force_login(people["bob"])
    page = bob.get(reverse("console:run", args=[run.workflow_id])).content.decode()
    shown = page.split("data-requested-plan>")[1].split("</ul>")[0]
    assert "<code>  amount: 120 → 125</code>" in shown and "post_entry: entry-" in shown

    with pytest.raises(InvalidTransition, match="another supervisor"):
        approval_grant(request_id=request.pk, actor=people["alice"], reason="mine")
    approval_grant(request_id=request.pk, actor=people["bob"], reason="checked the scan")
    run = drive(WorkflowRun.objects.get(pk=run.pk), clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts()["ledger"] == 2 and receivers.compensations()["reversal"] == 1
    assert run.steps.get(step_name="post_entry").intent == {"amount": 125, "category": "office"}
