"""Agent steps: the model calls tools in a loop the engine drives. Every model turn is journaled
before any tool it asks for runs, and every tool call is a row with its own key, intent,
attempts and outcome. After a crash at any boundary the run resumes from the journal: no
journaled turn is asked again, no recorded call is made again, an unknown call outcome is
reconciled by the tool's own contract."""

import hashlib
import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db.models import Q

from recovery.engine import failpoints, transitions
from recovery.engine.executor import advance
from recovery.engine.transitions import run_start
from recovery.errors import InvalidTransition
from recovery.models import AuditEvent, RunState, StepState
from recovery.testing import fault_matrix
from recovery.workflow import compensation_key, get_workflow
from tests.support import receivers
from tests.support.engine import advance_as_dying_workers, assert_invariants, drive, person, resolve_happened
from tests.support.models import RemoteObject
from tests.support.workflows import JOURNAL

pytestmark = pytest.mark.django_db


def start(order_id: str = "1", **data):
    return run_start(workflow="test_agent", data={"tenant": "t", "order_id": order_id, **data})[0]


def journal(run) -> list[tuple[str, str]]:
    return [(s.step_name, s.state) for s in run.steps.order_by("position", "id") if ":" in s.step_name]


def test_the_model_calls_tools_until_its_final_answer_and_each_effect_is_made_once(clock):
    run = drive(start(), clock)

    assert run.state == RunState.COMPLETED
    assert journal(run) == [(name, StepState.SUCCEEDED) for name in JOURNAL]
    assert receivers.counts() == {"task": 0, "message": 1, "ledger": 1, "model_call": 3}
    agent = run.steps.get(step_name="resolve")
    assert (agent.state, agent.result) == (StepState.SUCCEEDED, {"resolution": "credited", "amount": 120})
    assert run.steps.get(step_name="close").result == {"closed": "credited"}
    # Each call's key is hash(workflow_id:agent:turn:index:tool:vN), its intent the validated arguments.
    call = run.steps.get(step_name="resolve:2:0:credit")
    expected = hashlib.sha256(f"{run.workflow_id}:resolve:2:0:credit:v1".encode()).hexdigest()
    assert call.idempotency_key == expected
    assert call.intent == {"invoice": "inv-1", "amount": 120}
    assert call.attempts == 1 and call.remote_ref.startswith("entry-")
    # The turn that asked for it holds the model's reply, with the calls' ids and arguments.
    turn = run.steps.get(step_name="resolve:2").result
    assert [c["name"] for c in turn["tool_calls"]] == ["credit", "notify_customer"]
    assert turn["final"] is None
    assert run.steps.get(step_name="resolve:3").result["final"] == {"resolution": "credited", "amount": 120}
    assert_invariants()


def test_the_next_turn_is_asked_with_the_journaled_conversation(clock):
    seen = []
    original = receivers.agent_reply

    def spy(dispute, messages, tools):
        seen.append(json.loads(json.dumps(messages)))
        return original(dispute, messages, tools)

    receivers.agent_reply = spy
    try:
        drive(start(), clock)
    finally:
        receivers.agent_reply = original
    assert [len(m) for m in seen] == [0, 2, 5]
    assistant, tool = seen[1]
    assert assistant["tool_calls"][0]["function"]["name"] == "find_invoice"
    assert (tool["role"], tool["tool_call_id"]) == ("tool", assistant["tool_calls"][0]["id"])
    assert json.loads(tool["content"])["result"] == {"invoice": "inv-1", "amount": 120}


@pytest.mark.parametrize("point", failpoints.POINTS)
@pytest.mark.parametrize("row", JOURNAL)
def test_a_crash_at_any_boundary_of_any_turn_or_call_resumes_from_the_journal(clock, monkeypatch, row, point):
    run = start()
    monkeypatch.setenv("RECOVERY_FAILPOINTS", f"{row}:{point}=raise")
    run = advance_as_dying_workers(run, clock, rounds=1)
    monkeypatch.delenv("RECOVERY_FAILPOINTS")
    assert run.state == RunState.RUNNING  # the crashed executor still holds it, until its lease expired

    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    assert journal(run) == [(name, StepState.SUCCEEDED) for name in JOURNAL]
    # A turn is asked again only if the crash came after the model answered and before its
    # answer was journaled; a journaled turn never is.
    asked_again = int(":" not in row[len("resolve:") :] and point == "after_call")
    assert receivers.counts() == {"task": 0, "message": 1, "ledger": 1, "model_call": 3 + asked_again}
    assert run.steps.get(step_name="resolve").result == {"resolution": "credited", "amount": 120}
    assert_invariants()


@pytest.mark.parametrize("kind", ["ledger", "message"])
def test_a_call_whose_answer_is_lost_after_the_receiver_committed_is_looked_up_not_made_again(clock, kind):
    receivers.arm(kind, "commit_then_drop")
    run = drive(start(), clock)

    assert run.state == RunState.COMPLETED
    assert receivers.counts() == {"task": 0, "message": 1, "ledger": 1, "model_call": 3}
    name = "resolve:2:0:credit" if kind == "ledger" else "resolve:2:1:notify_customer"
    actions = list(AuditEvent.objects.filter(run=run, step_name=name).values_list("action", flat=True))
    assert actions == ["step_begin", "step_unknown", "reconciled"]


def test_a_transient_tool_failure_is_retried_with_the_same_key_and_the_turn_is_not_asked_again(clock):
    receivers.arm("ledger", "unavailable", times=2)
    run = drive(start(), clock)

    assert run.state == RunState.COMPLETED
    call = run.steps.get(step_name="resolve:2:0:credit")
    assert call.attempts == 3
    assert receivers.counts() == {"task": 0, "message": 1, "ledger": 1, "model_call": 3}


def test_invalid_arguments_are_answered_to_the_model_as_a_tool_error_and_nothing_is_made(clock):
    receivers.AGENT_SCRIPT.append(
        receivers.tool_calls(("credit", {"invoice": "inv-1", "amount": "lots"}), ("refund_everything", {}))
    )
    run = drive(start(), clock)

    assert run.state == RunState.COMPLETED
    bad = run.steps.get(step_name="resolve:1:0:credit")
    unknown_tool = run.steps.get(step_name="resolve:1:1:refund_everything")
    assert bad.state == unknown_tool.state == StepState.SKIPPED
    assert bad.attempts == 0 and "invalid arguments for credit" in bad.last_error
    assert "no tool named 'refund_everything'" in unknown_tool.last_error
    # Then the scripted model goes on (find, credit + notify, answer): one credit note.
    assert receivers.counts() == {"task": 0, "message": 1, "ledger": 1, "model_call": 4}
    assert run.steps.get(step_name="resolve").result["resolution"] == "refused"  # it saw the errors


def test_too_many_invalid_calls_send_the_run_to_review(clock):
    receivers.AGENT_SCRIPT.extend(
        [receivers.tool_calls(("credit", {"amount": -1})), receivers.tool_calls(("credit", {}), ("credit", {}))]
    )
    run = drive(start(), clock)

    assert run.state == RunState.NEEDS_REVIEW
    assert "3 tool call(s) with invalid arguments (budget 2)" in run.status_reason
    assert receivers.counts()["ledger"] == 0


def test_a_guard_refusal_is_answered_to_the_model_before_anything_is_sent(clock):
    run = drive(start(amount=900), clock)

    assert run.state == RunState.COMPLETED
    refused = run.steps.get(step_name="resolve:2:0:credit")
    assert refused.state == StepState.SKIPPED and refused.attempts == 0
    assert refused.refusal["rule"] == "credit_limit"
    assert receivers.counts() == {"task": 0, "message": 1, "ledger": 0, "model_call": 3}
    assert run.steps.get(step_name="resolve").result == {"resolution": "refused", "amount": 900}


def test_a_guard_refusal_holds_the_call_for_an_operator_when_the_agent_says_so(clock):
    run = run_start(workflow="test_agent_review", data={"tenant": "t", "order_id": "1", "amount": 900})[0]
    run = drive(run, clock)

    assert run.state == RunState.NEEDS_REVIEW
    held = run.steps.get(step_name="resolve:2:0:credit")
    assert held.state == StepState.PENDING and held.refusal["rule"] == "credit_limit"
    assert receivers.counts()["ledger"] == 0


def test_an_agent_without_a_final_answer_within_its_turns_goes_to_review(clock):
    receivers.AGENT_SCRIPT.extend([receivers.tool_calls(("find_invoice", {"invoice": "inv-1"}))] * 5)
    run = drive(start(), clock)

    assert run.state == RunState.NEEDS_REVIEW
    assert "no final answer after 5 model turn(s)" in run.status_reason
    assert receivers.counts()["model_call"] == 5


def test_an_invalid_final_answer_is_asked_again_within_the_format_budget(clock):
    receivers.AGENT_SCRIPT.extend(
        [receivers.tool_calls(("find_invoice", {"invoice": "inv-1"})), '{"resolution": "maybe", "amount": 1}']
    )
    run = drive(start(), clock)
    assert run.state == RunState.COMPLETED
    assert run.steps.get(step_name="resolve:2").format_failures == 1


def test_the_tools_are_declared_to_the_model_with_their_argument_schemas():
    spec = get_workflow("test_agent").get_step("resolve")
    definitions = {d["function"]["name"]: d["function"] for d in spec.agent.definitions()}
    assert set(definitions) == {"find_invoice", "credit", "notify_customer"}
    assert definitions["credit"]["description"] == "Post a credit note to the ledger."
    assert definitions["credit"]["parameters"]["required"] == ["invoice", "amount"]
    # A journal row's contract is its tool's, under the row's name.
    call = get_workflow("test_agent").get_step("resolve:4:2:credit")
    assert (call.name, call.reconcile, call.lookup_fn) == (
        "resolve:4:2:credit",
        "lookup",
        spec.agent.tools["credit"].lookup_fn,
    )


def test_an_operator_retries_a_failed_tool_call_with_the_same_key_and_no_turn_is_asked_again(clock):
    receivers.arm("ledger", "forbidden")
    run = drive(start(), clock)
    assert run.state == RunState.FAILED
    failed = run.steps.get(step_name="resolve:2:0:credit")
    assert (failed.state, failed.last_error_kind) == (StepState.FAILED, "permanent")

    transitions.step_retry(
        workflow_id=run.workflow_id, step_name=failed.step_name, actor=person("sam"), reason="ledger token renewed"
    )
    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    credit = run.steps.get(step_name="resolve:2:0:credit")
    assert credit.idempotency_key == failed.idempotency_key and credit.attempts == 2
    assert receivers.counts() == {"task": 0, "message": 1, "ledger": 1, "model_call": 3}


def test_an_operator_compensates_a_tool_calls_effect(clock):
    run = drive(start(), clock)
    credit = run.steps.get(step_name="resolve:2:0:credit")

    transitions.run_compensate(workflow_id=run.workflow_id, actor=person("sam"), reason="credited in error")
    run = drive(run, clock)

    credit.refresh_from_db()
    assert credit.state == StepState.COMPENSATED and credit.compensation_ref.startswith("reversal-")
    assert receivers.compensations() == {"task_cancel": 0, "correction": 0, "reversal": 1}
    assert receivers.counts()["ledger"] == 1 and run.state == RunState.COMPENSATED


def agent_effects(run) -> dict[str, int]:
    """Remote objects each tool call made, by its journal row: counted at the receivers by key."""
    keys = dict(run.steps.filter(step_name__contains=":").values_list("step_name", "idempotency_key"))
    return {
        name: RemoteObject.objects.filter(kind__in=("ledger", "message"))
        .filter(Q(dedupe_key=key) | Q(client_ref=key))
        .count()
        for name, key in keys.items()
    }


def agent_compensations(run) -> dict[str, int]:
    keys = dict(run.steps.filter(step_name__contains=":").values_list("step_name", "idempotency_key"))
    return {
        name: RemoteObject.objects.filter(
            kind="reversal", dedupe_key=compensation_key(run.workflow_id, name, 1)
        ).count()
        for name in keys
    }


test_agent_fault_matrix = fault_matrix(
    "test_agent",
    event=lambda n: {"tenant": "matrix", "order_id": f"a-{n}"},
    effects=agent_effects,
    compensations=agent_compensations,
)


# --- operators: stop the agent, let it go on, fork it from a turn ---------------------------


def waiting_on_a_failed_credit(clock):
    """A run whose credit note failed once (503) and waits for its retry, in turn 2."""
    receivers.arm("ledger", "unavailable")
    run = start()
    for _ in range(4):
        advance(run.pk)
    run.refresh_from_db()
    assert run.state == RunState.WAITING and run.steps.get(step_name="resolve:2:0:credit").state == StepState.FAILED
    return run


def test_an_operator_stops_the_agent_and_nothing_more_is_asked_or_sent_until_it_is_let_go_on(clock):
    run = waiting_on_a_failed_credit(clock)
    supervisor = person("sue")

    run = transitions.agent_stop(
        workflow_id=run.workflow_id, step_name="resolve", actor=person("oscar", "operator"), reason="runaway"
    )
    assert run.state == RunState.NEEDS_REVIEW and "stopped by oscar: runaway" in run.status_reason
    notify = run.steps.get(step_name="resolve:2:1:notify_customer")
    assert notify.state == StepState.SKIPPED and "not made: the agent was stopped" in notify.last_error
    run = drive(run, clock)  # resuming does not restart it: it stays with the operator
    assert run.state == RunState.NEEDS_REVIEW and receivers.counts()["model_call"] == 2

    transitions.run_resume(workflow_id=run.workflow_id, actor=supervisor, reason="looked fine")
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    # The failed credit note was retried under its key; the message left out was never sent.
    assert receivers.counts() == {"task": 0, "message": 0, "ledger": 1, "model_call": 3}
    assert run.steps.get(step_name="resolve").result["resolution"] == "refused"


def test_stopping_an_agent_whose_call_is_in_flight_fences_the_executor_and_the_call_is_reconciled(clock, monkeypatch):
    run = start()
    monkeypatch.setenv("RECOVERY_FAILPOINTS", "resolve:2:0:credit:after_call=raise")
    with pytest.raises(failpoints.FailpointRaised):
        advance(run.pk)
    monkeypatch.delenv("RECOVERY_FAILPOINTS")
    run.refresh_from_db()
    generation = run.lease_generation
    assert run.lease_owner  # its executor still holds it: the call's answer is not recorded

    run = transitions.agent_stop(workflow_id=run.workflow_id, step_name="resolve", actor=person("sue"), reason="halt")
    assert run.lease_generation == generation + 1 and not run.lease_owner
    assert run.steps.get(step_name="resolve:2:0:credit").state == StepState.UNKNOWN
    transitions.run_resume(workflow_id=run.workflow_id, actor=person("sam"), reason="go on")
    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    assert receivers.counts()["ledger"] == 1  # found by its key, not posted again


def test_a_fork_from_a_turn_asks_the_model_again_from_there_with_a_new_key_version(clock):
    run = waiting_on_a_failed_credit(clock)
    supervisor = person("sue")
    transitions.agent_stop(workflow_id=run.workflow_id, step_name="resolve", actor=supervisor, reason="wrong amount")

    transitions.agent_fork(workflow_id=run.workflow_id, step_name="resolve:2", actor=supervisor, reason="ask again")
    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    states = dict(run.steps.filter(step_name__contains=":").values_list("step_name", "state"))
    assert states == {
        "resolve:1": StepState.SUCCEEDED,
        "resolve:1:0:find_invoice": StepState.SUCCEEDED,
        "resolve:2": StepState.SKIPPED,  # left out of the conversation
        "resolve:2:0:credit": StepState.SKIPPED,
        "resolve:2:1:notify_customer": StepState.SKIPPED,
        "resolve:3": StepState.SUCCEEDED,
        "resolve:3:0:credit": StepState.SUCCEEDED,
        "resolve:3:1:notify_customer": StepState.SUCCEEDED,
        "resolve:4": StepState.SUCCEEDED,
    }
    credit = run.steps.get(step_name="resolve:3:0:credit")
    assert credit.key_version == 2
    assert credit.idempotency_key == hashlib.sha256(f"{run.workflow_id}:resolve:3:0:credit:v2".encode()).hexdigest()
    assert run.steps.get(step_name="resolve:3").key_version == 2
    assert receivers.counts() == {"task": 0, "message": 1, "ledger": 1, "model_call": 4}
    fork = AuditEvent.objects.get(run=run, action="agent_fork")
    assert fork.after["left_out"] == ["resolve:2", "resolve:2:0:credit"]  # the message: already, by the stop
    assert fork.actor == "sue" and fork.reason == "ask again"


def stuck_on_invalid_calls(clock):
    """Turn 1 asks for two calls with invalid arguments (the budget, 2), turn 2 for a third: review."""
    receivers.AGENT_SCRIPT.extend(
        [receivers.tool_calls(("credit", {}), ("credit", {"amount": -1})), receivers.tool_calls(("credit", {}))]
    )
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW
    assert "3 tool call(s) with invalid arguments (budget 2)" in run.status_reason
    assert receivers.counts()["model_call"] == 2
    return run


def test_invalid_calls_of_the_turns_a_fork_left_out_no_longer_count_against_the_budget(clock):
    """As the turns a fork leaves out no longer count against max_turns, their calls with invalid
    arguments no longer count against argument_errors: the model is asked again, not the run
    sent straight back to review."""
    run = stuck_on_invalid_calls(clock)
    transitions.agent_fork(workflow_id=run.workflow_id, step_name="resolve:2", actor=person("sue"), reason="again")
    run = drive(run, clock)

    assert run.state == RunState.COMPLETED, run.status_reason
    assert run.steps.get(step_name="resolve:2:0:credit").state == StepState.SKIPPED  # left out, never made
    assert receivers.counts() == {"task": 0, "message": 1, "ledger": 1, "model_call": 5}  # asked 3 more times


def test_invalid_calls_of_the_turns_a_fork_kept_still_count(clock):
    run = stuck_on_invalid_calls(clock)
    transitions.agent_fork(workflow_id=run.workflow_id, step_name="resolve:2", actor=person("sue"), reason="again")
    receivers.AGENT_SCRIPT.append(receivers.tool_calls(("credit", {"invoice": 7})))  # turn 3: one more
    run = drive(run, clock)

    assert run.state == RunState.NEEDS_REVIEW
    assert "3 tool call(s) with invalid arguments (budget 2)" in run.status_reason  # turn 1's two and turn 3's
    assert receivers.counts() == {"task": 0, "message": 0, "ledger": 0, "model_call": 3}


def test_a_fork_keeps_the_effects_already_made_until_they_are_compensated_explicitly(clock):
    receivers.arm("message", "unavailable")
    run = start()
    for _ in range(5):
        advance(run.pk)
    run.refresh_from_db()
    assert run.steps.get(step_name="resolve:2:0:credit").state == StepState.SUCCEEDED
    supervisor = person("sue")
    transitions.agent_stop(workflow_id=run.workflow_id, step_name="resolve", actor=supervisor, reason="check")
    transitions.agent_fork(workflow_id=run.workflow_id, step_name="resolve:2", actor=supervisor, reason="again")

    kept = run.steps.get(step_name="resolve:2:0:credit")
    assert kept.state == StepState.SUCCEEDED and kept.remote_ref  # its effect stands: still compensable
    run = drive(run, clock)
    assert receivers.counts()["ledger"] == 2  # the model, asked again, credited again: under a new key


@pytest.mark.parametrize(
    ("action", "step", "role", "refusal"),
    [
        ("fork_agent", "resolve:2", "operator", "needs the supervisor role"),
        ("stop_agent", "close", "operator", "close is not an agent step"),
        ("fork_agent", "resolve", "supervisor", "resolve is not a model turn"),
        ("override", "resolve", "supervisor", "resume the run to let it go on"),
    ],
)
def test_agent_actions_are_refused_with_a_reason_and_change_nothing(clock, action, step, role, refusal):
    run = waiting_on_a_failed_credit(clock)
    if action != "stop_agent":
        transitions.agent_stop(workflow_id=run.workflow_id, step_name="resolve", actor=person("s0"), reason="x")
    before = list(AuditEvent.objects.values_list("id", flat=True))
    with pytest.raises(InvalidTransition, match=refusal):
        transitions.perform(action, workflow_id=run.workflow_id, step_name=step, actor=person("u", role), reason="r")
    assert list(AuditEvent.objects.values_list("id", flat=True)) == before


def test_a_finished_agent_cannot_be_stopped_or_forked(clock):
    run = drive(start(), clock)
    for action, step in (("stop_agent", "resolve"), ("fork_agent", "resolve:2")):
        with pytest.raises(InvalidTransition):
            transitions.perform(action, workflow_id=run.workflow_id, step_name=step, actor=person(action), reason="r")


def test_stop_and_fork_from_the_shell_go_through_the_same_transitions_and_checks(clock):
    run = waiting_on_a_failed_credit(clock)
    person("olga", "operator")
    person("sue")
    out = StringIO()

    call_command(
        "recover", "stop_agent", run.workflow_id, "--step", "resolve", "--reason", "r", "--as", "olga", stdout=out
    )
    with pytest.raises(CommandError, match="needs the supervisor role"):
        call_command("recover", "fork_agent", run.workflow_id, "--step", "resolve:2", "--reason", "r", "--as", "olga")
    with pytest.raises(CommandError, match="resolve is not a model turn"):
        call_command("recover", "fork_agent", run.workflow_id, "--step", "resolve", "--reason", "r", "--as", "sue")
    call_command(
        "recover", "fork_agent", run.workflow_id, "--step", "resolve:2", "--reason", "r", "--as", "sue", stdout=out
    )

    actions = list(AuditEvent.objects.filter(run=run, actor__in=["olga", "sue"]).values_list("actor", "action"))
    assert actions == [("olga", "agent_stop"), ("sue", "agent_fork")]
    assert drive(run, clock).state == RunState.COMPLETED


def test_a_declaration_that_cannot_be_journaled_is_refused_at_import():
    from pydantic import BaseModel

    from recovery.registry import _REGISTRY
    from recovery.workflow import Workflow

    class Args(BaseModel):
        n: int

    wf = Workflow("test_agent_declarations", version=1, workflow_id=lambda i: "x")
    with pytest.raises(ValueError, match="letters, digits, _ and - only"):
        wf.tool(arguments=Args, name="look up")(lambda ctx: None)
    with pytest.raises(ValueError, match="already has a tool"):
        wf.tool(arguments=Args, name="t")(lambda ctx: None)
        wf.tool(arguments=Args, name="t")(lambda ctx: None)
    with pytest.raises(ValueError, match="is not a tool of workflow"):
        wf.agent(tools=[get_workflow("test_agent").tools["credit"]], schema=Args)
    with pytest.raises(ValueError, match="at least one tool"):
        wf.agent(tools=[], schema=Args)
    with pytest.raises(ValueError, match="marks an agent's journal rows"):
        wf.step(name="a:b")(lambda ctx: None)
    with pytest.raises(ValueError, match="refusals="):
        wf.agent(tools=[wf.tools["t"]], schema=Args, refusals="ignore")
    with pytest.raises(ValueError, match="guard its tools"):
        wf.agent(tools=[wf.tools["t"]], schema=Args, name="ask")(lambda ctx: None).guard("rule")
    _REGISTRY.pop("test_agent_declarations")


def test_a_run_that_fails_after_a_tool_wrote_says_its_effects_stand(clock):
    receivers.arm("message", "forbidden")
    run = drive(start(), clock)

    assert run.state == RunState.FAILED
    assert run.effects_stand is True  # the credit note stands: the console lists it under "Failed, effects stand"
    assert receivers.counts()["ledger"] == 1


def test_a_run_that_fails_before_any_tool_wrote_has_no_standing_effects(clock):
    receivers.arm("ledger", "forbidden")
    run = drive(start(), clock)

    assert run.state == RunState.FAILED and run.effects_stand is False  # find_invoice only read


def test_an_operator_settles_an_unknown_tool_outcome_with_evidence_and_the_agent_goes_on(clock, monkeypatch):
    credit = get_workflow("test_agent").tools["credit"]
    monkeypatch.setattr(credit, "lookup_fn", lambda ctx: None)  # the ledger's look-up cannot see it
    monkeypatch.setattr(credit, "settle", None)  # and may still commit it at any time: a person decides
    receivers.arm("ledger", "commit_then_drop")
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW
    call = run.steps.get(step_name="resolve:2:0:credit")
    assert call.state == StepState.UNKNOWN and receivers.counts()["ledger"] == 1

    entry = RemoteObject.objects.get(kind="ledger")
    resolve_happened(
        workflow_id=run.workflow_id,
        step_name=call.step_name,
        actor=person("sue"),
        reason="found it in the ledger by hand",
        remote_ref=f"entry-{entry.pk}",
    )
    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    call.refresh_from_db()
    assert (call.state, call.remote_ref) == (StepState.SUCCEEDED, f"entry-{entry.pk}")
    assert receivers.counts() == {"task": 0, "message": 1, "ledger": 1, "model_call": 3}  # no second entry


def test_resuming_a_run_keeps_the_refusals_already_answered_to_the_model(clock):
    receivers.arm("message", "forbidden")  # the run fails after the refused credit note was answered
    run = drive(start(amount=900), clock)
    assert run.state == RunState.FAILED

    transitions.run_resume(workflow_id=run.workflow_id, actor=person("sue"), reason="messenger fixed")

    refused = run.steps.get(step_name="resolve:2:0:credit")
    assert refused.state == StepState.SKIPPED and refused.refusal["rule"] == "credit_limit"
    assert refused.last_error.startswith("policy refused: credit_limit")
    assert drive(run, clock).state == RunState.COMPLETED
