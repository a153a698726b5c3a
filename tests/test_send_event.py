"""``manage.py send_event``: an operator delivers the event a run's durable wait waits for, as
the sending system would on the API (issue 38), through the same transition, recorded as sent by
them. The same key again is nothing new; an event after its deadline is recorded, not applied;
every refusal is one line and a non-zero exit, and writes nothing."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunEvent, RunState, StepState, WorkflowRun
from tests.support import receivers
from tests.support.engine import drive, person

pytestmark = pytest.mark.django_db

APPROVED = {"approved": True, "amount": 120, "by": "alice"}
KEY = "tracker:17:approved"


def started(order_id: str = "o-1") -> WorkflowRun:
    return run_start(workflow="test_approvals", data={"tenant": "t", "order_id": order_id})[0]


def send(workflow_id: str, *arguments: str, payload=APPROVED, key: str = KEY, user: str = "olga") -> str:
    out = StringIO()
    given = ["--payload", json.dumps(payload)] if payload is not None else []
    call_command("send_event", workflow_id, "approved", "--key", key, *given, *arguments, "--as", user, stdout=out)
    return out.getvalue()


def written() -> tuple[int, int, int]:
    return (
        RunEvent.objects.count(),
        AuditEvent.objects.count(),
        sum(WorkflowRun.objects.values_list("revision", flat=True)),
    )


def test_an_operator_sends_the_event_and_the_run_goes_on_from_it(clock):
    olga = person("olga", "operator")
    run = drive(started(), clock)
    assert run.state == RunState.WAITING

    assert send(run.workflow_id) == f"event approved ({KEY}) recorded for approval:t:o-1: the run goes on\n"
    kept = RunEvent.objects.get()
    assert (kept.sent_by, kept.payload, kept.late, kept.step_name) == ("olga", APPROVED, False, "approval")
    received = AuditEvent.objects.get(run=run, action="event_received")
    assert (received.actor, received.actor_user_id) == ("olga", olga.pk)

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert run.steps.get(step_name="approval").remote_ref == KEY
    assert receivers.counts()["ledger"] == 1


def test_the_payload_may_come_from_a_file(clock, tmp_path):
    person("olga", "operator")
    run = drive(started(), clock)
    path = tmp_path / "approval.json"
    path.write_text(json.dumps(APPROVED), encoding="utf-8")
    out = send(run.workflow_id, "--payload-file", str(path), payload=None)
    assert out.endswith(": the run goes on\n") and RunEvent.objects.get().payload == APPROVED


def test_the_same_key_again_is_nothing_new(clock):
    person("olga", "operator")
    run = drive(started(), clock)
    send(run.workflow_id)
    before = written()
    again = send(run.workflow_id, payload=dict(APPROVED))
    assert again == f"event approved ({KEY}) already recorded for approval:t:o-1 (the same key): nothing new\n"
    assert written() == before
    assert drive(run, clock).state == RunState.COMPLETED and receivers.counts()["ledger"] == 1


def test_an_event_after_the_deadline_is_recorded_late_and_not_applied(clock):
    person("olga", "operator")
    run = drive(started(), clock)
    clock.advance(timedelta(days=3).total_seconds() + 1)
    out = send(run.workflow_id)
    assert out == f"event approved ({KEY}) recorded late for approval:t:o-1: its wait had ended, it is not applied\n"
    assert RunEvent.objects.get().late
    run = drive(run, clock)
    assert run.state == RunState.NEEDS_REVIEW and run.steps.get(step_name="approval").state == StepState.FAILED
    assert receivers.counts()["ledger"] == 0


def test_an_event_before_its_wait_is_kept_for_it(clock):
    person("olga", "operator")
    run = started()
    out = send(run.workflow_id)
    assert (
        out == f"event approved ({KEY}) recorded for approval:t:o-1: kept for its wait, used when the run reaches it\n"
    )
    assert drive(run, clock).state == RunState.COMPLETED and receivers.counts()["ledger"] == 1


@pytest.mark.parametrize(
    "workflow_id, arguments, payload, key, user, refusal",
    [
        ("approval:t:nope", [], APPROVED, KEY, "olga", "no run 'approval:t:nope'"),
        ("", [], {**APPROVED, "amount": -1}, KEY, "olga", "event 'approved' refused by approval: "),
        ("", [], {**APPROVED, "note": "x"}, KEY, "olga", "refused by approval: "),
        ("", [], {**APPROVED, "amount": 5}, "tracker:first", "olga", "'tracker:first' was used for another event"),
        ("", [], APPROVED, " ", "olga", "an event needs the sender's idempotency key"),
        ("", [], APPROVED, KEY, "nobody", "no active user 'nobody'"),
        ("", [], APPROVED, KEY, "gone", "no active user 'gone'"),
        ("", [], APPROVED, KEY, "vic", r"vic \(viewer\) may not send events: that needs the operator role"),
        ("", ["--payload", "{not json"], None, KEY, "olga", "--payload is not valid JSON"),
        ("", ["--payload", "[1]"], None, KEY, "olga", "--payload must be a JSON object"),
        ("", ["--payload-file", "/nonexistent/a.json"], None, KEY, "olga", "cannot read /nonexistent/a.json"),
    ],
)
def test_a_refusal_is_one_line_and_writes_nothing(clock, workflow_id, arguments, payload, key, user, refusal):
    person("olga", "operator"), person("vic", "viewer")
    gone = person("gone", "operator")
    gone.is_active = False
    gone.save()
    run = drive(started(), clock)
    send(run.workflow_id, key="tracker:first")
    before = written()
    with pytest.raises(CommandError, match=refusal):
        send(workflow_id or run.workflow_id, *arguments, payload=payload, key=key, user=user)
    assert written() == before


def test_an_event_for_a_finished_run_or_one_it_does_not_wait_for_is_refused(clock):
    person("olga", "operator")
    run = started()
    send(run.workflow_id)
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    before = written()
    with pytest.raises(CommandError, match="is completed: an event for it is not recorded"):
        send(run.workflow_id, key="tracker:again")
    with pytest.raises(CommandError, match=r"waits for no event 'rejected' \(it waits for: approved\)"):
        call_command("send_event", run.workflow_id, "rejected", "--key", "k", "--payload", "{}", "--as", "olga")
    assert written() == before


@pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])  # checks, then closes the connections
def test_from_the_command_line_a_refusal_is_one_line_on_stderr_and_exit_1(clock, capsys):
    from django.core.management import ManagementUtility

    person("olga", "operator")
    arguments = ["manage.py", "send_event", "approval:t:nope", "approved", "--key", KEY, "--payload", "{}"]
    with pytest.raises(SystemExit) as exited:
        ManagementUtility([*arguments, "--as", "olga"]).execute()
    assert exited.value.code == 1
    assert capsys.readouterr().err == "CommandError: no run 'approval:t:nope'\n"
    assert written() == (0, 0, 0)
