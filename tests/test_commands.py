"""docs/operating.md "Commands" commands: names, output shapes, and bad input that changes nothing."""

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from recovery.engine import transitions
from recovery.models import AuditEvent, RunState, WorkflowRun
from tests.support.engine import person

pytestmark = pytest.mark.django_db(transaction=True)

EVENT = {"tenant": "t42", "order_id": "inv-1847", "text": "office chairs 120"}


def run_cmd(*args, **kwargs) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO(), **kwargs)
    return out.getvalue().strip()


def test_start_workflow_prints_the_stable_workflow_id_for_the_same_event():
    first = run_cmd("start_workflow", "test_orders", "--input", json.dumps(EVENT))
    second = run_cmd("start_workflow", "test_orders", "--input", json.dumps(EVENT))
    assert first == second == "order:t42:inv-1847"
    assert WorkflowRun.objects.count() == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["test_orders", "--input", "{not json"], "not valid JSON"),
        (["nope", "--input", "{}"], "unknown workflow 'nope'"),
        (["test_orders", "--input", '{"tenant": "t"}'], "order_id"),
        (["test_orders", "--input", "[1, 2]"], "JSON object"),
    ],
)
def test_start_workflow_rejects_bad_input_and_writes_nothing(args, message):
    with pytest.raises(CommandError, match=message):
        run_cmd("start_workflow", *args)
    assert WorkflowRun.objects.count() == 0 and AuditEvent.objects.count() == 0


def test_same_workflow_id_with_a_different_input_is_a_conflict():
    run_cmd("start_workflow", "test_orders", "--input", json.dumps(EVENT))
    with pytest.raises(CommandError, match="different input"):
        run_cmd("start_workflow", "test_orders", "--input", json.dumps({**EVENT, "text": "changed 999"}))
    assert WorkflowRun.objects.get().input["text"] == EVENT["text"]


def test_run_executor_until_idle_completes_and_show_run_prints_the_spec_shape():
    wid = run_cmd("start_workflow", "test_orders", "--input", json.dumps(EVENT))
    assert "advanced 1 run" in run_cmd("run_executor", "--until-idle")
    doc = json.loads(run_cmd("show_run", wid, "--json"))
    assert {"workflow_id", "state", "current_step", "steps", "audit"} <= set(doc)
    assert doc["state"] == "completed"
    assert [s["name"] for s in doc["steps"]] == ["read", "decide", "create_task", "notify", "post_entry"]
    for s in doc["steps"]:
        assert {"name", "state", "attempts", "idempotency_key", "remote_ref", "last_error_kind", "last_error"} <= set(s)
        assert len(s["idempotency_key"]) == 64
    assert doc["steps"][2]["remote_ref"].startswith("task-")
    assert doc["audit"][0]["action"] == "start" and doc["audit"][-1]["after"]["run"] == "completed"
    for e in doc["audit"]:
        assert {"at", "actor", "action", "reason", "before", "after"} <= set(e)


def test_show_run_of_an_unknown_run_is_an_error():
    with pytest.raises(CommandError, match="no run"):
        run_cmd("show_run", "order:x:y", "--json")


def test_show_run_wait_returns_once_the_run_rests_and_says_so_when_it_does_not():
    wid = run_cmd("start_workflow", "test_orders", "--input", json.dumps(EVENT))
    err = StringIO()
    with pytest.raises(CommandError, match=f"{wid} is still pending after 0.2 s: due now"):
        call_command("show_run", wid, "--wait", "0.2", stdout=err, stderr=StringIO())
    assert err.getvalue().startswith(f"{wid}  pending")  # shown all the same

    run_cmd("run_executor", "--until-idle")
    assert run_cmd("show_run", wid, "--wait", "300").startswith(f"{wid}  completed")  # at once: it rests


class _ReaderGone(StringIO):
    """stdout of ``show_run … | head`` once head has read its lines: the next write breaks the pipe."""

    def __init__(self, lines: int) -> None:
        super().__init__()
        self.left = lines

    def write(self, text: str) -> int:
        if self.left == 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.left -= 1
        return super().write(text)


def test_show_run_piped_into_head_stops_quietly_and_names_the_run_page(settings):
    settings.RECOVERY_CONSOLE_URL = "http://127.0.0.1:8123"
    wid = run_cmd("start_workflow", "test_orders", "--input", json.dumps(EVENT))
    out = run_cmd("show_run", wid)
    assert f"  page: http://127.0.0.1:8123/runs/{wid}" in out.splitlines()[:3]  # the port of this deployment
    err = StringIO()
    with pytest.raises(SystemExit) as stopped:  # no traceback: the reader has gone, the command stops
        call_command("show_run", wid, stdout=_ReaderGone(3), stderr=err)
    assert stopped.value.code == 141 and err.getvalue() == ""


def test_show_run_wait_a_run_whose_executor_died_rests_only_while_no_executor_is_live(clock, settings):
    """A running run whose lease expired is taken over by a live executor (make run restarts its
    own): until then it is still moving; with no executor live it rests, and says so."""
    wid = run_cmd("start_workflow", "test_orders", "--input", json.dumps(EVENT))
    run = WorkflowRun.objects.get(workflow_id=wid)
    assert transitions.run_claim(run_pk=run.pk, owner="dead@host:1") is not None  # and it dies holding it
    clock.advance(settings.RECOVERY_LEASE_SECONDS + 1)
    transitions.executor_register(mode="embedded", owner="new@host:2")
    with pytest.raises(CommandError, match=f"{wid} is still running after 0.2 s"):
        call_command("show_run", wid, "--wait", "0.2", stdout=StringIO(), stderr=StringIO())
    clock.advance(settings.RECOVERY_EXECUTOR_SILENT_SECONDS + 1)  # the new one fell silent too
    assert run_cmd("show_run", wid, "--wait", "300").startswith(f"{wid}  running")  # rests: a person must act


def test_show_run_wait_rejects_a_negative_wait_and_an_unknown_run():
    with pytest.raises(CommandError, match="--wait must be 0 or more seconds"):
        run_cmd("show_run", "order:x:y", "--wait", "-1")
    with pytest.raises(CommandError, match="no run 'order:x:y'"):
        run_cmd("show_run", "order:x:y", "--wait", "5")


def test_recover_refuses_a_finished_run_and_unknown_users():
    person("olga")
    wid = run_cmd("start_workflow", "test_orders", "--input", json.dumps(EVENT))
    run_cmd("run_executor", "--until-idle")
    events = AuditEvent.objects.count()
    with pytest.raises(CommandError, match="cannot be resumed"):
        run_cmd("recover", "resume", wid, "--reason", "again", "--as", "olga")
    with pytest.raises(CommandError, match="no active user"):
        run_cmd("recover", "terminate", wid, "--reason", "x", "--as", "nobody")
    with pytest.raises(CommandError, match="needs --step"):
        run_cmd("recover", "retry", wid, "--reason", "x", "--as", "olga")
    assert AuditEvent.objects.count() == events
    assert WorkflowRun.objects.get().state == RunState.COMPLETED


def test_recover_terminate_is_audited_with_the_operator():
    person("olga")
    wid = run_cmd("start_workflow", "test_orders", "--input", json.dumps(EVENT))
    assert run_cmd("recover", "terminate", wid, "--reason", "duplicate invoice", "--as", "olga").endswith("terminated")
    event = AuditEvent.objects.get(action="terminate")
    assert (event.actor, event.reason, event.before, event.after) == (
        "olga",
        "duplicate invoice",
        {"run": "pending"},
        {"run": "terminated"},
    )


def test_recover_checks_the_role_as_the_console_does():
    person("vera", "viewer")
    person("otto", "operator")
    person("nora", None)
    wid = run_cmd("start_workflow", "test_orders", "--input", json.dumps(EVENT))
    events = AuditEvent.objects.count()
    refusals = [
        ("vera", "resume", "viewer", "resume", "operator"),
        ("otto", "terminate", "operator", "terminate", "supervisor"),
        ("nora", "resume", "none", "resume", "operator"),
        ("otto", "supersede", "operator", "change the decision", "supervisor"),
        ("otto", "decide_again", "operator", "ask the model again", "supervisor"),
        ("otto", "override", "operator", "accept the refused proposal", "supervisor"),
    ]
    for username, action, role, label, needed in refusals:
        with pytest.raises(
            CommandError, match=rf"^{username} \({role}\) may not {label}: that needs the {needed} role$"
        ):
            run_cmd("recover", action, wid, "--step", "decide", "--decision", "{}", "--reason", "x", "--as", username)
    assert AuditEvent.objects.count() == events
    assert WorkflowRun.objects.get().state == RunState.PENDING


def test_approval_commands_request_list_and_approve_with_two_supervisors(clock):
    from tests.support import receivers

    person("alice")
    person("bob")
    person("otto", "operator")
    receivers.arm("task", "forbidden")
    wid = run_cmd("start_workflow", "test_guarded", "--input", json.dumps(EVENT))
    run_cmd("run_executor", "--until-idle")
    assert WorkflowRun.objects.get().state == RunState.FAILED
    with pytest.raises(CommandError, match="needs a second supervisor's approval"):
        run_cmd("recover", "terminate", wid, "--reason", "x", "--as", "alice")

    made = run_cmd("approval", "request", "terminate", wid, "--reason", "duplicate", "--as", "alice")
    request_id = made.split()[1].rstrip(":")
    assert made == f"request {request_id}: terminate waits for a second supervisor's approval"
    listed = run_cmd("approval", "list").split("\t")
    assert listed[:4] == [request_id, "terminate", wid, "alice"] and listed[-1] == "duplicate"
    with pytest.raises(CommandError, match="cannot approve your own request"):
        run_cmd("approval", "approve", request_id, "--reason", "ok", "--as", "alice")
    with pytest.raises(CommandError, match="otto's role may not approve runs"):
        run_cmd("approval", "approve", request_id, "--reason", "ok", "--as", "otto")
    with pytest.raises(CommandError, match="no approval request 'nope'"):
        run_cmd("approval", "approve", "nope", "--reason", "ok", "--as", "bob")
    with pytest.raises(CommandError, match="--reason"):  # an approval gives its reason, as every action does
        run_cmd("approval", "approve", request_id, "--as", "bob")
    with pytest.raises(CommandError, match="a reason is required"):
        run_cmd("approval", "approve", request_id, "--reason", " ", "--as", "bob")
    assert WorkflowRun.objects.get().state == RunState.FAILED

    approved = run_cmd("approval", "approve", request_id, "--reason", "duplicate of INV-7", "--as", "bob")
    assert approved == f"approved {request_id}: {wid} is now terminated"
    assert run_cmd("approval", "list") == ""
    actions = list(AuditEvent.objects.order_by("id").values_list("action", "actor"))[-3:]
    assert actions == [("approval_request", "alice"), ("approval_grant", "bob"), ("terminate", "bob")]


def test_an_event_whose_workflow_id_is_too_long_starts_nothing():
    event = {**EVENT, "order_id": "x" * 300}
    with pytest.raises(CommandError, match="the workflow id must be 1 to 255 characters"):
        run_cmd("start_workflow", "test_orders", "--input", json.dumps(event))
    assert not WorkflowRun.objects.exists() and not AuditEvent.objects.exists()


def test_recover_resolve_happened_settles_an_unknown_step_from_the_shell(clock):
    """A worker died inside create_task's call; terminating the run records the step unknown.
    The operator found the task in the tracker: `recover resolve_happened` records it, with
    its remote id, through the console's own transition."""
    from recovery.engine.executor import advance
    from recovery.models import StepState
    from tests.support import receivers
    from tests.support.engine import crash_at

    person("olga")
    wid = run_cmd("start_workflow", "test_orders", "--input", json.dumps(EVENT))
    crash_at(pytest.MonkeyPatch(), "create_task:after_call", lambda: advance(WorkflowRun.objects.get().pk))
    run_cmd("recover", "terminate", wid, "--reason", "duplicate order", "--as", "olga")
    task_ref = f"task-{receivers.RemoteObject.objects.get(kind='task').pk}"
    events = AuditEvent.objects.count()
    with pytest.raises(CommandError, match="resolve_happened needs --step"):
        run_cmd("recover", "resolve_happened", wid, "--reason", "found it", "--as", "olga")
    assert AuditEvent.objects.count() == events
    out = run_cmd(
        "recover", "resolve_happened", wid, "--step", "create_task", "--remote-ref", task_ref,
        "--reason", "found it in the tracker", "--as", "olga",
    )  # fmt: skip
    assert out == f"resolve_happened: {wid} is now terminated"
    step = WorkflowRun.objects.get().steps.get(step_name="create_task")
    assert (step.state, step.remote_ref) == (StepState.SUCCEEDED, task_ref)
    event = AuditEvent.objects.filter(step_name="create_task").latest("id")
    assert (event.actor, event.reason) == ("olga", "found it in the tracker")
    assert receivers.counts()["task"] == 1


def test_recover_offers_every_action_the_run_page_accepts():
    """One vocabulary (recovery/actions.py): whatever the console's run page posts, recover takes."""
    from recovery.actions import ACTIONS, PERMISSION_OF
    from recovery.management.commands.recover import Command

    parser = Command().create_parser("manage.py", "recover")
    choices = next(a.choices for a in parser._actions if a.dest == "action")
    assert set(choices) == set(PERMISSION_OF) == {*ACTIONS, "approve", "reject"}
    assert {"resolve_happened", "resolve_absent", "supersede", "decide_again", "override"} <= set(choices)


def refused_run(clock) -> str:
    """A test_policy run whose model named the wrong approver: stopped before any write."""
    from tests.support import receivers

    receivers.MODEL_SCRIPT.append(json.dumps({"category": "office", "amount": 120, "approver": "mallory"}))
    wid = run_cmd("start_workflow", "test_policy", "--input", json.dumps(EVENT))
    run_cmd("run_executor", "--until-idle")
    assert WorkflowRun.objects.get(workflow_id=wid).state == RunState.NEEDS_REVIEW
    return wid


def test_recover_supersedes_a_decision_from_a_file_and_the_run_completes_with_it(clock, tmp_path):
    from tests.support import receivers

    person("sam")
    wid = refused_run(clock)
    bad = tmp_path / "bad.json"
    bad.write_text('{"category": "office", "amount": -5, "approver": "alice"}')
    events = AuditEvent.objects.count()
    for args, message in [
        (["--decision-file", str(bad)], "does not match Decision: amount"),
        (["--decision", "{oops"], "the decision is not valid JSON"),
        (["--decision-file", str(tmp_path / "missing.json")], "cannot read"),
        ([], "give the new decision as a JSON object"),
    ]:
        with pytest.raises(CommandError, match=message):
            run_cmd("recover", "supersede", wid, "--step", "decide", *args, "--reason", "x", "--as", "sam")
    assert AuditEvent.objects.count() == events

    good = tmp_path / "decision.json"
    good.write_text('{"category": "office", "amount": 120, "approver": "alice"}')
    out = run_cmd(
        "recover",
        "supersede",
        wid,
        "--step",
        "decide",
        "--decision-file",
        str(good),
        "--reason",
        "policy",
        "--as",
        "sam",
    )
    assert out == f"supersede: {wid} is now pending"
    event = AuditEvent.objects.get(action="decision_supersede")
    assert (event.actor, event.after["decision"]["approver"]) == ("sam", "alice")
    run_cmd("run_executor", "--until-idle")
    assert WorkflowRun.objects.get().state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}


def test_recover_overrides_a_refused_rule_or_asks_the_model_again(clock):
    from tests.support import receivers

    person("sam")
    wid = refused_run(clock)
    # Asked again, the model still names mallory: refused again, still nothing written.
    receivers.MODEL_SCRIPT.append(json.dumps({"category": "office", "amount": 120, "approver": "mallory"}))
    run_cmd("recover", "decide_again", wid, "--step", "decide", "--reason", "ask again", "--as", "sam")
    run_cmd("run_executor", "--until-idle")
    assert receivers.counts() == {"task": 0, "message": 0, "ledger": 0, "model_call": 2}
    assert WorkflowRun.objects.get().status_reason.startswith("policy refused: approver_policy")

    out = run_cmd("recover", "override", wid, "--step", "create_task", "--reason", "CFO agreed", "--as", "sam")
    assert out == f"override: {wid} is now pending"
    assert AuditEvent.objects.get(action="policy_override").after["override"]["rule"] == "approver_policy"
    run_cmd("run_executor", "--until-idle")
    assert WorkflowRun.objects.get().state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 2}


def test_recover_approves_and_rejects_a_four_eyes_request_of_that_run(clock):
    from tests.support import receivers

    person("alice")
    person("bob")
    receivers.arm("task", "forbidden")
    wid = run_cmd("start_workflow", "test_guarded", "--input", json.dumps(EVENT))
    run_cmd("run_executor", "--until-idle")
    made = run_cmd("approval", "request", "terminate", wid, "--reason", "duplicate", "--as", "alice")
    request_id = made.split()[1].rstrip(":")
    with pytest.raises(CommandError, match="approve needs --request"):
        run_cmd("recover", "approve", wid, "--reason", "ok", "--as", "bob")
    with pytest.raises(CommandError, match="no approval request '999' on this run"):
        run_cmd("recover", "approve", wid, "--request", "999", "--reason", "ok", "--as", "bob")
    with pytest.raises(CommandError, match="cannot approve your own request"):
        run_cmd("recover", "approve", wid, "--request", request_id, "--reason", "ok", "--as", "alice")
    assert WorkflowRun.objects.get().state == RunState.FAILED
    out = run_cmd("recover", "approve", wid, "--request", request_id, "--reason", "checked", "--as", "bob")
    assert out == f"approve: request {request_id} is approved; {wid} is now terminated"
    assert AuditEvent.objects.filter(action="approval_grant", actor="bob").count() == 1


def test_recover_snooze_alert_is_a_supervisor_s_and_needs_a_firing_alert():
    from recovery.engine.transitions import alert_raise
    from recovery.models import Alert, AlertState

    person("sue")
    person("otto", "operator")
    wid = run_cmd("start_workflow", "test_orders", "--input", json.dumps(EVENT))
    with pytest.raises(CommandError, match="has no alert firing"):
        run_cmd("recover", "snooze_alert", wid, "--reason", "known", "--as", "sue")
    run = WorkflowRun.objects.get()
    alert_raise(run_pk=run.pk, cause="needs_review", revision=run.revision, why="waiting", channels=[])
    with pytest.raises(CommandError, match="needs the supervisor role"):
        run_cmd("recover", "snooze_alert", wid, "--reason", "known", "--as", "otto")
    run_cmd("recover", "snooze_alert", wid, "--reason", "the ledger is down until 6", "--as", "sue")
    alert = Alert.objects.get()
    assert (alert.state, alert.snoozed_by, alert.snooze_reason) == (
        AlertState.SNOOZED,
        "sue",
        "the ledger is down until 6",
    )
    assert AuditEvent.objects.get(action="alert_snoozed").actor == "sue"


def test_start_workflow_reads_json_lines_in_batches_and_answers_line_by_line(tmp_path):
    first = run_cmd("start_workflow", "test_orders", "--input", json.dumps(EVENT))
    events = tmp_path / "events.jsonl"
    events.write_text(
        "\n".join(
            [
                json.dumps({"tenant": "t", "order_id": "n1"}),
                json.dumps(EVENT),  # started before: its run
                "",  # a blank line is skipped
                "{not json",
                json.dumps({**EVENT, "text": "travel 10"}),  # the same id, another input
                json.dumps({"tenant": "t", "order_id": "n2"}),
                json.dumps({"tenant": "t"}),
            ]
        )
    )
    out = StringIO()
    with pytest.raises(CommandError, match="3 of 6 events refused"):
        call_command("start_workflow", "test_orders", "--input-file", str(events), "--batch", "2", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "created order:t:n1" and lines[1] == f"existing {first}"
    assert lines[2].startswith("invalid line 4: not valid JSON")
    assert lines[3].startswith(f"conflict line 5: run {first} already exists with a different input")
    assert lines[4] == "created order:t:n2" and lines[5].startswith("invalid line 7: order_id")
    assert len(lines) == 6
    assert set(WorkflowRun.objects.values_list("workflow_id", flat=True)) == {first, "order:t:n1", "order:t:n2"}


def test_recover_snooze_alert_takes_how_long_and_refuses_a_bad_duration():
    from recovery.engine.transitions import alert_raise
    from recovery.models import Alert, AlertState

    person("sue")
    wid = run_cmd("start_workflow", "test_orders", "--input", json.dumps(EVENT))
    run = WorkflowRun.objects.get()
    alert_raise(run_pk=run.pk, cause="needs_review", revision=run.revision, why="waiting", channels=[])
    for hours, message in [("0", "at most 168 hours"), ("200", "at most 168 hours"), ("two", "as a number")]:
        with pytest.raises(CommandError, match=message):
            run_cmd("recover", "snooze_alert", wid, "--hours", hours, "--reason", "known", "--as", "sue")
    with pytest.raises(CommandError, match="resume takes no duration"):
        run_cmd("recover", "resume", wid, "--hours", "2", "--reason", "known", "--as", "sue")
    assert Alert.objects.get().state == AlertState.FIRING
    assert not AuditEvent.objects.filter(action="alert_snoozed").exists()

    run_cmd("recover", "snooze_alert", wid, "--hours", "2", "--reason", "ledger down until 8", "--as", "sue")
    alert, event = Alert.objects.get(), AuditEvent.objects.get(action="alert_snoozed")
    assert alert.state == AlertState.SNOOZED and alert.snoozed_until - event.at == timedelta(hours=2)
