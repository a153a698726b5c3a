"""An operator's "it succeeded, remote id X" is evidence, checked like a request before it is
recorded (recovery.engine.evidence): at the receiver (the step's @lookup_ref must find X and X must
be the step's own), or against the step's declared result schema; and the next step must be
buildable from the result. A refusal records nothing; an accepted one is the step's result exactly
as a reconcile would record it, and the run goes on from it."""

import pytest
from pydantic import BaseModel, ConfigDict

from recovery.engine import evidence, transitions
from recovery.engine.transitions import Situation, offered, run_start
from recovery.errors import InvalidTransition
from recovery.models import AuditEvent, RunState, StepExecution, StepState
from tests.support import receivers, workflows
from tests.support.console import unknown_run
from tests.support.engine import drive, person, resolve_happened

pytestmark = pytest.mark.django_db


def message_ref(run=None) -> str:
    """The message the messenger holds for ``run``'s notify (the only one when ``run`` is None)."""
    messages = receivers.RemoteObject.objects.filter(kind="message")
    if run is not None:
        messages = messages.filter(client_ref=StepExecution.objects.get(run=run, step_name="notify").idempotency_key)
    return f"msg-{messages.get().pk}"


def recorded(run) -> tuple:
    """What a refusal must leave as it was: the step, the run and the audit trail."""
    notify = StepExecution.objects.get(run=run, step_name="notify")
    run.refresh_from_db()
    return notify.state, notify.remote_ref, notify.result, run.state, AuditEvent.objects.filter(run=run).count()


def test_the_receivers_own_result_is_recorded_and_the_run_completes_with_one_object_per_step(clock, monkeypatch):
    run = unknown_run(clock, monkeypatch)
    assert StepExecution.objects.get(run=run, step_name="notify").state == StepState.UNKNOWN
    monkeypatch.undo()
    # the look-up by key stays down: only the operator's evidence can settle it
    monkeypatch.setattr(workflows.notify, "lookup_fn", lambda ctx: (_ for _ in ()).throw(RuntimeError("down")))
    ref = message_ref()

    resolve_happened(
        workflow_id=run.workflow_id, step_name="notify", actor=person("sue"), reason="seen", remote_ref=ref
    )

    notify = StepExecution.objects.get(run=run, step_name="notify")
    pk = receivers.RemoteObject.objects.get(kind="message").pk
    # exactly what send_message / find_message record: not {"remote_ref": …, "resolved_by": …}
    assert (notify.state, notify.remote_ref, notify.result) == (StepState.SUCCEEDED, ref, {"message_id": pk})
    event = AuditEvent.objects.get(run=run, action="resolve")
    assert event.actor == "sue" and event.after["evidence"]["checked"].startswith("looked up at the receiver")
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}


def test_another_runs_object_or_an_unknown_id_is_refused_naming_why_and_nothing_is_recorded(clock, monkeypatch):
    run = unknown_run(clock, monkeypatch)
    other = unknown_run(clock, monkeypatch, order_id="o-other")  # its own message, under its own key
    theirs = message_ref(other)
    assert other.workflow_id != run.workflow_id
    before = recorded(run)
    sue = person("sue")

    for ref, said in [
        (theirs, f"{theirs} is not notify's object: {theirs} belongs to another request"),
        ("no such thing!!", "the receiver has no no such thing!!"),
        ("msg-999999", "the receiver has no msg-999999"),
        ("  ", "give the remote id"),
    ]:
        with pytest.raises(InvalidTransition, match=said.replace("!", r"\!")):
            resolve_happened(workflow_id=run.workflow_id, step_name="notify", actor=sue, reason="seen", remote_ref=ref)
        assert recorded(run) == before

    receivers.arm("message_get", "unavailable")  # the receiver cannot be asked now: nothing is assumed
    with pytest.raises(InvalidTransition, match="the receiver could not be asked for .*try again when it answers"):
        resolve_happened(
            workflow_id=run.workflow_id, step_name="notify", actor=sue, reason="seen", remote_ref=message_ref(run)
        )
    assert recorded(run) == before


class Delivery(BaseModel):
    """A messenger with no look-up by id: what the operator reads off its screen."""

    model_config = ConfigDict(extra="forbid")
    message_id: int
    channel: str = "email"


def test_where_the_receiver_cannot_be_asked_the_operator_fills_the_declared_result(clock, monkeypatch):
    run = unknown_run(clock, monkeypatch)
    monkeypatch.undo()
    monkeypatch.setattr(workflows.notify, "lookup_fn", lambda ctx: (_ for _ in ()).throw(RuntimeError("down")))
    monkeypatch.setattr(workflows.notify, "lookup_ref_fn", None)
    monkeypatch.setattr(workflows.notify, "result_schema", Delivery)
    before, ref, sue = recorded(run), message_ref(), person("sue")
    examine = {"workflow_id": run.workflow_id, "step_name": "notify", "remote_ref": ref, "actor": sue}

    for result, said in [
        (None, r"fill in its result \(Delivery\)"),
        ("not json", "the result is not valid JSON"),
        ("[1]", "the result must be a JSON object"),
        ('{"message_id": "x"}', "does not match Delivery: message_id: Input should be a valid integer"),
        ('{"message_id": 1, "by": "me"}', "by: Extra inputs are not permitted"),
    ]:
        with pytest.raises(InvalidTransition, match=said):
            evidence.examine("resolve_happened", result=result, **examine)
        assert recorded(run) == before

    checked = evidence.examine("resolve_happened", result='{"message_id": 7}', **examine)
    assert checked == {
        "remote_ref": ref,
        "result": {"message_id": 7, "channel": "email"},
        "checked": "filled in by sue, valid Delivery",
    }
    transitions.step_resolve(
        workflow_id=run.workflow_id,
        step_name="notify",
        actor=sue,
        reason="seen",
        happened=True,
        evidence=checked,
    )
    assert drive(run, clock).state == RunState.COMPLETED
    assert receivers.counts()["message"] == 1


def test_a_result_the_next_step_cannot_be_built_from_is_refused_before_it_is_recorded(clock, monkeypatch):
    run = unknown_run(clock, monkeypatch)
    monkeypatch.undo()
    monkeypatch.setattr(workflows.notify, "lookup_ref_fn", None)
    monkeypatch.setattr(workflows.notify, "result_schema", Delivery)
    # post_entry's request carries the message's id: a result without it cannot go on
    monkeypatch.setattr(
        workflows.post_entry, "intent_fn", lambda ctx: {"amount": 1, "message": ctx.result("notify")["message_id"] + 1}
    )

    class Loose(BaseModel):
        model_config = ConfigDict(extra="allow")

    monkeypatch.setattr(workflows.notify, "result_schema", Loose)
    before = recorded(run)
    with pytest.raises(
        InvalidTransition, match=r"post_entry, the next step, cannot be built .*KeyError.*nothing recorded"
    ):
        evidence.examine(
            "resolve_happened",
            workflow_id=run.workflow_id,
            step_name="notify",
            remote_ref=message_ref(),
            result='{"seen": "yes"}',
            actor=person("sue"),
        )
    assert recorded(run) == before


def test_a_step_whose_evidence_cannot_be_checked_is_not_offered_it_succeeded_and_says_why(clock, monkeypatch):
    run = unknown_run(clock, monkeypatch)
    monkeypatch.setattr(workflows.notify, "lookup_ref_fn", None)  # and no result schema either
    steps = StepExecution.objects.filter(run=run)
    situation = Situation.of(run, steps, clock.now())
    offers = offered(situation, person("sue"))
    assert ("resolve_happened", "notify") not in offers and ("reconcile", "notify") in offers
    with pytest.raises(InvalidTransition, match="evidence cannot be checked, so it cannot be recorded"):
        evidence.examine(
            "resolve_happened", workflow_id=run.workflow_id, step_name="notify", remote_ref=message_ref(), actor=None
        )


def test_the_transition_records_only_checked_evidence(clock, monkeypatch):
    run = unknown_run(clock, monkeypatch)
    before, sue = recorded(run), person("sue")
    for given in (None, {"remote_ref": "msg-1"}, {"remote_ref": "", "result": {}, "checked": "x"}):
        with pytest.raises(InvalidTransition):
            transitions.step_resolve(
                workflow_id=run.workflow_id,
                step_name="notify",
                actor=sue,
                reason="trust me",
                happened=True,
                evidence=given,
            )
    assert recorded(run) == before


def test_a_four_eyes_request_keeps_the_checked_evidence_and_the_grant_records_it(clock, monkeypatch):
    receivers.arm("message", "commit_then_drop")
    monkeypatch.setattr(workflows.notify, "lookup_fn", lambda ctx: (_ for _ in ()).throw(RuntimeError("down")))
    run = drive(run_start(workflow="test_guarded", data={"tenant": "t", "order_id": "g-ev"})[0], clock)
    assert StepExecution.objects.get(run=run, step_name="notify").state == StepState.UNKNOWN
    olga, alice = person("olga"), person("alice")
    ref = message_ref()
    checked = evidence.examine(
        "resolve_happened", workflow_id=run.workflow_id, step_name="notify", remote_ref=ref, actor=olga
    )
    request = transitions.approval_request(
        workflow_id=run.workflow_id,
        action="resolve_happened",
        step_name="notify",
        evidence=checked,
        actor=olga,
        reason="seen in the messenger",
    )
    assert request.remote_ref == ref and request.options == {"evidence": checked}
    transitions.approval_grant(request_id=request.pk, actor=alice, reason="checked")
    notify = StepExecution.objects.get(run=run, step_name="notify")
    assert (notify.state, notify.result) == (StepState.SUCCEEDED, checked["result"])
    monkeypatch.undo()
    assert drive(run, clock).state == RunState.COMPLETED and receivers.counts()["message"] == 1
