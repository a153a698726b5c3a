"""``seed_demo`` (docs/operating.md "Commands"): a realistic mix of invoice runs, every one made by the engine's own
transitions against the simulated systems over real HTTP, never by writing rows. Seeding twice
changes nothing (rule 1: the same event is the same run), and no side effect exists twice. Two of
the invoices run on the workflow's previous version, v1: one a supervisor may move to v2, one not."""

import json
import socket
import time
from collections import Counter
from datetime import timedelta
from io import StringIO

import httpx
import pytest
from django.conf import settings as django_settings
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from recovery import clock as engine_clock
from recovery import counts, testing
from recovery.engine import transitions
from recovery.errors import InvalidTransition
from recovery.models import (
    AccountEvent,
    AuditEvent,
    DecisionState,
    ModelDecision,
    OutboxMessage,
    OutboxState,
    RunState,
    StepExecution,
    StepState,
    WorkflowRun,
)
from recovery.workflow import get_workflow
from sandbox import demo, demo_logins, demo_player, demo_seed, faults
from sandbox.management.commands.seed_demo import DISPUTES, SCENARIOS, sandbox_server
from sandbox.models import Fault, LedgerEntry, Message, MessageKind, Task, TaskStatus
from tests.support.engine import subprocess_env

RUNS = len(SCENARIOS) + len(DISPUTES)
SANDBOX_AUTH = {"Authorization": f"Bearer {django_settings.SANDBOX_API_KEY}"}

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])]

NOTHING = {
    "tasks": 0,
    "tasks_cancelled": 0,
    "messages": 0,
    "corrections": 0,
    "ledger_entries": 0,
    "ledger_reversals": 0,
}
ON_V1 = {"invoice:hooli:HL-887", "invoice:stark:SI-7779"}  # stopped before its approval task; past it
MIX = {
    RunState.COMPLETED: 7,  # 5 invoices, 2 disputes
    RunState.WAITING: 2,  # an invoice waiting for its retry; the dispute whose credit note waits for a supervisor
    RunState.NEEDS_REVIEW: 6,  # 5 invoices (1 on v1), the stopped dispute
    RunState.FAILED: 2,  # 1 on v1
    RunState.COMPENSATED: 1,
    RunState.COMPENSATION_FAILED: 1,
}


def unreachable_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def seed(*args) -> str:
    out, err = StringIO(), StringIO()
    call_command("seed_demo", *args, stdout=out, stderr=err)
    assert err.getvalue() == ""  # every scenario ended in the state its story says
    return out.getvalue().strip()


def run(workflow_id: str) -> WorkflowRun:
    return WorkflowRun.objects.get(workflow_id=workflow_id)


def step(workflow_id: str, name: str) -> StepExecution:
    return StepExecution.objects.get(run__workflow_id=workflow_id, step_name=name)


def sandbox_objects() -> dict:
    return {
        "counts": faults.counts(),
        "tasks": sorted(Task.objects.values_list("pk", "status")),
        "messages": sorted(Message.objects.values_list("pk", flat=True)),
        "ledger": sorted(LedgerEntry.objects.values_list("pk", flat=True)),
    }


def counts_of(workflow_id: str) -> dict[str, int]:
    """What `sandbox counts --run` reports for the run."""
    out = StringIO()
    call_command("sandbox", "counts", "--run", workflow_id, "--json", stdout=out)
    return json.loads(out.getvalue())


def plan_to_v2(workflow_id: str) -> transitions.MovePlan:
    moving = run(workflow_id)
    rows = list(moving.steps.all())
    return transitions.move_plan(moving, rows, get_workflow("invoice", 2), transitions.accepted_decisions(moving))


def test_seed_demo_makes_every_state_with_one_effect_per_run_and_a_second_seed_adds_nothing(settings):
    settings.DEBUG = True  # the demo users
    settings.SANDBOX_URL = unreachable_url()  # nothing answers there: the seed serves the sandbox itself

    line = seed()

    assert line.startswith(f"seed_demo: {RUNS} demo runs, 15 invoices (2 on invoice v1) and 4 disputes ({RUNS} new): ")
    assert Counter(WorkflowRun.objects.values_list("state", flat=True)) == MIX
    # Two versions: the two older invoices on v1, every other invoice on v3 (the current one).
    versions = dict(WorkflowRun.objects.filter(workflow_name="invoice").values_list("workflow_id", "workflow_version"))
    assert {wid for wid, version in versions.items() if version == 1} == ON_V1
    assert (
        {version for wid, version in versions.items() if wid not in ON_V1} == {get_workflow("invoice").version} == {3}
    )
    for state, count in MIX.items():
        assert f"{state} {count}" in line
    assert len({r.input["tenant"] for r in WorkflowRun.objects.all()}) >= 5

    # Exactly one task per run that got that far, one message per delivered notification,
    # one ledger entry per posted step: no side effect exists twice.
    task_keys = sorted(Task.objects.values_list("idempotency_key", flat=True))
    created = StepExecution.objects.filter(step_name="create_approval_task", attempts__gt=0).exclude(
        last_error_kind="permanent", state=StepState.FAILED
    )
    assert task_keys == sorted(created.values_list("idempotency_key", flat=True))
    told = list(
        StepExecution.objects.filter(step_name__endswith=":notify_customer").values_list("idempotency_key", flat=True)
    )
    sent = Message.objects.filter(kind=MessageKind.MESSAGE).exclude(client_ref__in=told)  # the approvers'
    delivered = OutboxMessage.objects.filter(state=OutboxState.DELIVERED)
    assert sorted(sent.values_list("client_ref", flat=True)) == sorted(
        delivered.values_list("idempotency_key", flat=True)
    )
    posted = StepExecution.objects.filter(step_name="post_ledger_entry", remote_ref__startswith="le_")
    assert sorted(LedgerEntry.objects.filter(kind="entry", amount__gt=0).values_list("reference", flat=True)) == sorted(
        posted.values_list("run__workflow_id", flat=True)
    )
    # The disputes: a credit note for the stated overcharge, a refused one escalated, a stopped agent.
    credited = step("dispute:acme:D-501", "resolve_dispute:2:0:issue_credit_note")
    [note] = LedgerEntry.objects.filter(kind="entry", amount__lt=0)
    assert (note.reference, str(note.amount)) == (credited.idempotency_key, "-120.00")
    assert step("dispute:initech:D-502", "resolve_dispute").result["outcome"] == "escalated"
    assert step("dispute:initech:D-502", "resolve_dispute:2:0:issue_credit_note").refusal["rule"] == "credit_limit"
    held = step("dispute:globex:D-504", "resolve_dispute:2:0:issue_credit_note")
    assert (held.state, held.intent["amount"], held.approval["role"]) == (StepState.WAITING, "600.00", "supervisor")
    assert run("dispute:globex:D-504").next_wake_at > engine_clock.now()  # days away: nobody decided yet
    stopped = run("dispute:hooli:D-503")
    assert stopped.state == RunState.NEEDS_REVIEW and "stopped by supervisor" in stopped.status_reason
    causes = counts.stuck_causes(engine_clock.now())  # listed as what is true: stopped, not exhausted
    assert [c for c, (_, q) in causes.items() if WorkflowRun.objects.filter(q, pk=stopped.pk).exists()] == [
        "needs_review",
        "agent_stopped",
    ]
    assert faults.counts() == {
        "tasks": 11,
        "tasks_cancelled": 1,
        "messages": 11,  # 9 approvers, 2 customers
        "corrections": 2,
        "ledger_entries": 8,  # 7 invoices, 1 credit note
        "ledger_reversals": 1,
    }
    assert not Fault.objects.exists()  # the seed's faults were all consumed and removed

    # Each state is the one its story says, made by the engine.
    unknown = step("invoice:acme:INV-1002", "create_approval_task")
    assert unknown.state == StepState.UNKNOWN and not unknown.remote_ref
    assert Task.objects.filter(idempotency_key=unknown.idempotency_key).count() == 1  # a reconcile will find it
    assert run("invoice:acme:INV-1002").state == RunState.NEEDS_REVIEW
    assert step("invoice:globex:GX-2024-118", "create_approval_task").last_error_kind == "permanent"
    invalid = ModelDecision.objects.filter(run__workflow_id="invoice:initech:IN-5532", state=DecisionState.INVALID)
    assert invalid.count() == 3 and all("bribes" in d.invalid_output for d in invalid)
    refused = run("invoice:globex:GX-2024-119")
    assert refused.status_reason.startswith("policy refused: approval_policy: it-lead@example.com is not the approver")
    assert not Task.objects.filter(payload__invoice_id="GX-2024-119").exists()
    waiting = run("invoice:wayne:WE-3302")
    assert waiting.next_wake_at > timezone.now() + timedelta(minutes=9)
    assert step("invoice:wayne:WE-3302", "post_ledger_entry").last_error_kind == "rate_limited"
    assert step("invoice:umbrella:UMB-0043", "create_approval_task").state == StepState.COMPENSATION_FAILED
    # No first-play invoice was taken for a duplicate of another one (same tenant, amount, currency).
    assert not WorkflowRun.objects.filter(status_reason__contains="not_a_duplicate").exists()
    off_schema = run("invoice:hooli:HL-887")  # on v1: stopped at classify, before any task
    assert (
        off_schema.state == RunState.NEEDS_REVIEW and step(off_schema.workflow_id, "classify").state == StepState.FAILED
    )
    assert counts_of(off_schema.workflow_id) == NOTHING
    refused = run("invoice:stark:SI-7779")  # on v1: the ledger refused after the task and the message
    assert (
        refused.state == RunState.FAILED
        and step(refused.workflow_id, "post_ledger_entry").last_error_kind == "permanent"
    )
    assert counts_of(refused.workflow_id)["tasks"] == counts_of(refused.workflow_id)["messages"] == 1
    by_hand = AuditEvent.objects.exclude(actor="executor")
    assert (
        sorted(by_hand.values_list("actor", "action"))
        == [("supervisor", "agent_stop")] + [("supervisor", "compensate")] * 2
    )
    assert all(r.created_at <= timezone.now() and not r.lease_owner for r in WorkflowRun.objects.all())
    assert StepExecution.objects.filter(state=StepState.RUNNING).count() == 0

    password = demo_logins.demo_password()  # generated once per checkout: it passes the validators
    for role in ("viewer", "operator", "supervisor"):
        user = get_user_model().objects.get(username=role)
        assert user.check_password(password) and user.groups.filter(name=role).exists()
        assert not user.check_password(role)
    created = AccountEvent.objects.filter(via="seed_demo", action="created")
    assert sorted(created.values_list("username", "after")) == [(r, r) for r in ("operator", "supervisor", "viewer")]

    before = sandbox_objects()
    events = AuditEvent.objects.count()
    account_events = AccountEvent.objects.count()
    line = seed()
    assert f"({RUNS} new)" not in line and "(0 new)" in line
    assert WorkflowRun.objects.count() == RUNS
    assert AuditEvent.objects.count() == events
    assert AccountEvent.objects.count() == account_events  # nothing changed, nothing recorded
    assert sandbox_objects() == before


def test_a_supervisor_moves_the_demos_v1_run_stopped_before_its_task_to_v2_and_not_the_one_past_it(settings):
    """docs/workflows.md "Deploying new versions": a run finishes on the version it started on, unless
    a supervisor moves it to a version that can continue it. HL-887 (v1) stopped at classify, before
    its approval task: v2 can continue it (it adds check_duplicate), and once moved and resumed it
    completes on v2 with one task, one message and one ledger entry. SI-7779 (v1) has made its
    approval task, step 3 of v1 and step 4 of v2: its move is refused, naming that step, and changes
    nothing."""
    settings.DEBUG = True
    settings.SANDBOX_URL = unreachable_url()
    seed()
    supervisor = get_user_model().objects.get(username="supervisor")

    assert plan_to_v2("invoice:hooli:HL-887").summary() == "can move to v2 (adds check_duplicate)"
    refusal = (
        "cannot move to v2: create_approval_task is step 3 of this run and step 4 of v2: the steps before it differ"
    )
    assert plan_to_v2("invoice:stark:SI-7779").summary() == refusal
    # What the README's tour (step 7) shows a supervisor on each run's page.
    console = Client()
    console.force_login(supervisor)
    for workflow_id, said in (
        ("invoice:hooli:HL-887", "can move to v2 (adds check_duplicate)"),
        ("invoice:stark:SI-7779", refusal),
    ):
        page = console.get(f"/runs/{workflow_id}").text
        assert "Move to another version" in page and f"v2: {said}</option>" in page

    stuck = run("invoice:stark:SI-7779")
    steps = sorted(stuck.steps.values_list("step_name", "state", "idempotency_key", "remote_ref"))
    before, events = sandbox_objects(), AuditEvent.objects.count()
    with pytest.raises(InvalidTransition) as refused:
        transitions.perform(
            "move_version", workflow_id=stuck.workflow_id, actor=supervisor, reason="v1 is going away", version=2
        )
    assert str(refused.value) == refusal
    assert (run(stuck.workflow_id).workflow_version, run(stuck.workflow_id).state) == (1, RunState.FAILED)
    assert sorted(stuck.steps.values_list("step_name", "state", "idempotency_key", "remote_ref")) == steps
    assert AuditEvent.objects.count() == events and sandbox_objects() == before

    moved = transitions.perform(
        "move_version",
        workflow_id="invoice:hooli:HL-887",
        actor=supervisor,
        reason="v1 is going away; the model answers on schema again",
        version=2,
    )
    assert (moved.workflow_version, moved.state) == (2, RunState.NEEDS_REVIEW)  # it waits for a resume
    move = AuditEvent.objects.get(run=moved, action="move_version")
    assert (move.actor, move.before["version"]) == ("supervisor", 1)
    with sandbox_server(unreachable_url()) as url:
        settings.SANDBOX_URL = url
        transitions.perform("resume", workflow_id=moved.workflow_id, actor=supervisor, reason="moved to v2")
        clock = testing.MovableClock()
        with engine_clock.driven_by(clock.now):
            done = testing.drive(moved, clock, owner="test-executor", must_settle=True)
    assert (done.state, done.workflow_version) == (RunState.COMPLETED, 2)
    assert step(done.workflow_id, "check_duplicate").result["duplicate_of"] == []
    assert counts_of(done.workflow_id) == {**NOTHING, "tasks": 1, "messages": 1, "ledger_entries": 1}
    assert counts_of(stuck.workflow_id) == {**NOTHING, "tasks": 1, "messages": 1}  # the refused one: as it was


def test_seed_demo_uses_a_sandbox_that_answers_at_the_given_url(live_server):
    with sandbox_server(live_server.url) as url:
        assert url == live_server.url
    assert httpx.get(f"{live_server.url}/sandbox/tasks/", headers=SANDBOX_AUTH).status_code == 200


def test_seed_demo_serves_the_sandbox_itself_while_it_runs_when_nothing_answers():
    with sandbox_server(unreachable_url()) as url:
        assert httpx.get(f"{url}/sandbox/tasks/", headers=SANDBOX_AUTH).json() == {"results": []}
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/sandbox/tasks/")


def test_seed_demo_refuses_a_sandbox_with_foreign_faults_armed_and_writes_nothing(settings):
    settings.DEBUG = True
    faults.set_fault("tasks", "create", "forbidden", times=3)
    with pytest.raises(CommandError, match="1 armed fault"):
        seed("--sandbox-url", unreachable_url())
    assert not WorkflowRun.objects.exists() and not get_user_model().objects.exists()
    assert Fault.objects.get().remaining == 3


def test_seed_demo_without_debug_needs_a_supervisor_and_writes_nothing_without_one(settings):
    settings.DEBUG = False
    with pytest.raises(CommandError, match="supervisor"):
        seed("--sandbox-url", unreachable_url())
    assert not WorkflowRun.objects.exists() and not get_user_model().objects.exists()


def test_reset_plays_the_demo_again_as_new_runs_and_terminates_the_unfinished_ones_deleting_nothing(
    settings, monkeypatch
):
    settings.DEBUG = True
    settings.SANDBOX_URL = unreachable_url()
    seed()
    first = {r.workflow_id: r.state for r in WorkflowRun.objects.all()}
    unfinished = {wid for wid, state in first.items() if state not in ("completed", "compensated")}
    events = AuditEvent.objects.count()
    counted = {wid: counts_of(wid) for wid in first}
    tasks = dict(Task.objects.values_list("pk", "status"))
    assert Counter(tasks.values()) == {TaskStatus.OPEN: 10, TaskStatus.CANCELLED: 1}

    # An executor running beside the seed (make run's) tries to take every run the seed plays,
    # between every step it drives, and every message it delivers: the reservation refuses it.
    intruded = []
    advance, publish = demo_player.advance, demo_player.publish

    def intruding_advance(run_pk, *, owner):
        intruded.append(transitions.run_claim(run_pk=run_pk, owner="make-run", now=timezone.now()))
        return advance(run_pk, owner=owner)

    def intruding_publish(pk, *, owner):
        intruded.append(transitions.outbox_claim(pk=pk, owner="make-run", now=timezone.now()))
        return publish(pk, owner=owner)

    monkeypatch.setattr(demo_player, "advance", intruding_advance)
    monkeypatch.setattr(demo_player, "publish", intruding_publish)
    line = seed("--reset", "--as", "supervisor")

    assert f"({RUNS} new), generation 2 (ids end in -r2)" in line
    assert f"{len(unfinished)} unfinished run(s) of the previous generation terminated" in line
    assert "10 open approval task(s) of earlier generations done in the tracker" in line
    assert len(intruded) > 2 * len(SCENARIOS) and set(intruded) == {None}
    second = WorkflowRun.objects.exclude(workflow_id__in=first)
    assert Counter(second.values_list("state", flat=True)) == MIX  # the same stories again
    # Each invoice and dispute again, on the same version, to the same end (none a duplicate of its first play).
    assert {r.workflow_id: r.state for r in second} == {f"{wid}-r2": state for wid, state in first.items()}
    assert {r.workflow_id: r.workflow_version for r in second} == {
        f"{r.workflow_id}-r2": r.workflow_version for r in WorkflowRun.objects.filter(workflow_id__in=first)
    }
    # The tracker's approvers worked through the first play's open tasks (done, not cancelled), so
    # what each old run made reads as before; the second play's tasks are open again.
    assert {pk: status for pk, status in Task.objects.values_list("pk", "status") if pk in tasks} == {
        pk: TaskStatus.DONE if status == TaskStatus.OPEN else status for pk, status in tasks.items()
    }
    assert Counter(Task.objects.exclude(pk__in=tasks).values_list("status", flat=True)) == Counter(tasks.values())
    assert {wid: counts_of(wid) for wid in first} == counted
    assert not WorkflowRun.objects.filter(reserved_for__isnull=False).exists()  # handed to the executors
    # Nothing deleted: the first generation is all there, its unfinished runs terminated by the supervisor.
    for wid, state in first.items():
        assert run(wid).state == ("terminated" if wid in unfinished else state)
    terminations = AuditEvent.objects.filter(action="terminate")
    assert sorted(terminations.values_list("run__workflow_id", flat=True)) == sorted(unfinished)
    assert {(e.actor, e.reason.split(":")[0]) for e in terminations} == {("supervisor", "demo reset by supervisor")}
    assert AuditEvent.objects.count() > events
    # One effect per run again: the second play's objects carry its own keys.
    assert Task.objects.count() == 2 * 11 and LedgerEntry.objects.filter(kind="entry").count() == 2 * 8
    refused = run("invoice:globex:GX-2024-119-r2")
    assert refused.status_reason.startswith("policy refused: approval_policy")  # the model's script followed

    assert "(0 new), generation 2" in seed()  # seeding again adds nothing to the current generation


def test_a_second_seed_while_one_plays_is_refused_and_writes_nothing(settings):
    settings.DEBUG = True
    with demo_seed._one_seed_at_a_time():
        with pytest.raises(CommandError, match="another seed_demo is playing"):
            seed("--sandbox-url", unreachable_url(), "--reset")
    assert not WorkflowRun.objects.exists()


def test_reset_as_someone_who_is_not_a_supervisor_is_refused_and_writes_nothing(settings):
    settings.DEBUG = True
    with pytest.raises(CommandError, match="no active supervisor 'operator'"):
        seed("--sandbox-url", unreachable_url(), "--reset", "--as", "operator")
    assert not WorkflowRun.objects.exists()


def test_the_demo_pages_reset_button_plays_the_demo_again_in_a_process_of_its_own(settings, monkeypatch, tmp_path):
    """The supervisor's button on /demo: refused without the confirmation (nothing starts),
    then `seed_demo --reset --as supervisor` in a process of its own, against this database."""
    settings.DEBUG = True
    settings.SANDBOX_URL = unreachable_url()
    seed()
    for name, value in subprocess_env(SANDBOX_URL=unreachable_url(), DJANGO_DEBUG="1").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(demo, "RESET_LOG", tmp_path / "seed_demo.log")
    client = Client()
    client.force_login(get_user_model().objects.get(username="supervisor"))

    refused = client.post("/demo", {"what": "reset"})
    assert refused.status_code == 400 and "tick the box to reset" in refused.text
    assert not demo.RESET_LOG.exists()

    page = client.get("/demo")
    assert "The demo runs are generation 1." in page.text and "Reset the demo" in page.text
    started = client.post("/demo", {"what": "reset", "confirm": "yes"})
    assert started.status_code == 200
    assert "reset started by supervisor: the demo runs play again as new runs (ids ending in -r2)" in started.text

    deadline = time.monotonic() + 600  # a hang guard: the child plays a dozen scenarios
    while "seed_demo:" not in demo.RESET_LOG.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    output = demo.RESET_LOG.read_text()
    assert f"({RUNS} new), generation 2 (ids end in -r2)" in output, output
    assert WorkflowRun.objects.filter(workflow_id__endswith="-r2").count() == RUNS
    assert AuditEvent.objects.filter(action="terminate", actor="supervisor").count() == 11  # the held dispute too
    page = client.get("/demo")
    assert "The demo runs are generation 2 (ids ending in -r2)." in page.text
    assert "generation 2 (ids end in -r2)" in page.text  # the last reset's output, on the page
