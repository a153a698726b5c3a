"""``manage.py check_deploy`` (issue 32): run with the code about to be deployed, it lists the
unfinished runs whose version that code lacks, says per group whether they can move to the
current version, exits non-zero when the deploy would strand runs, and ``--move`` moves the ones
that can through the same transition as the console. ``check --database default`` warns too."""

import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from recovery.engine.executor import advance
from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunState, WorkflowRun
from recovery.workflow import get_workflow
from tests.support import receivers
from tests.support.engine import drive, person

pytestmark = pytest.mark.django_db(transaction=True)


def v1_run(order_id: str, *, past_create_task: bool = False) -> WorkflowRun:
    if past_create_task:
        receivers.arm("ledger", "rate_limit")
    run = run_start(workflow=get_workflow("test_versioned", 1), data={"tenant": "t", "order_id": order_id})[0]
    if past_create_task:
        advance(run.pk)  # the task made, the ledger entry waits for its retry
    run.refresh_from_db()
    return run


def check_deploy(*args) -> tuple[str, str | None]:
    """(stdout, the one-line error when it exits non-zero)."""
    out = StringIO()
    try:
        call_command("check_deploy", *args, stdout=out, stderr=StringIO())
    except CommandError as exc:
        return out.getvalue(), str(exc)
    return out.getvalue(), None


def test_nothing_stranded_is_safe_to_deploy():
    v1_run("fine")  # v1 is deployed here
    out, error = check_deploy()
    assert error is None
    assert "no unfinished run needs a version this code lacks: safe to deploy" in out
    assert "test_versioned v1 and v2" in out


def test_a_deploy_without_v1_would_strand_its_runs_and_says_which_can_move(clock, undeploy):
    v1_run("fresh")
    v1_run("late", past_create_task=True)
    undeploy("test_versioned", 1)

    out, error = check_deploy()
    assert error == (
        "this deploy would strand 2 unfinished run(s) (1 can move to the current version): keep their versions "
        "deployed until they drain, or move them (check_deploy --move)"
    )
    lines = out.splitlines()
    assert "test_versioned v2" in lines[0]
    assert any(
        line.startswith("test_versioned v1 not started: 1 run(s) (pending 1;") and line.endswith("all can move to v2")
        for line in lines
    ), out
    assert any(
        line.startswith("test_versioned v1 at post_entry: 1 run(s) (waiting 1;")
        and line.endswith(
            "1 cannot: cannot move to v2: create_task is step 2 of this run and step 3 of v2: the steps "
            "before it differ (1)"
        )
        for line in lines
    ), out

    doc, error = check_deploy("--json")
    found = json.loads(doc)
    assert error and found["stranded"] == 2 and found["movable"] == 1
    assert found["deployed"]["test_versioned"] == [2]
    by_step = {g["step"]: g for g in found["groups"]}
    assert by_step[""]["runs"] == 1 and by_step[""]["movable"] == 1 and by_step[""]["target"] == 2
    assert by_step["post_entry"]["states"] == {"waiting": 1} and by_step["post_entry"]["movable"] == 0
    assert by_step["post_entry"]["examples"] == ["versioned:t:late"]


def test_check_deploy_move_moves_what_can_move_and_the_moved_run_completes(clock, undeploy):
    fresh, late = v1_run("fresh"), v1_run("late", past_create_task=True)
    person("sam", "supervisor")
    undeploy("test_versioned", 1)
    args = ("--move", "--reason", "v1 retired", "--as", "sam")

    out, error = check_deploy(*args, "--dry-run")
    assert f"would move {fresh.workflow_id} v1 -> v2: can move to v2 (adds check)" in out
    assert f"refused {late.workflow_id}: cannot move to v2: create_task is step 2" in out
    assert error == "would move 1 run(s); 1 cannot move"
    assert not AuditEvent.objects.filter(action="move_version").exists()

    out, error = check_deploy(*args)
    assert f"moved {fresh.workflow_id} v1 -> v2" in out and error == "moved 1 run(s); 1 cannot move"
    fresh.refresh_from_db()
    late.refresh_from_db()
    assert (fresh.workflow_version, late.workflow_version) == (2, 1)
    event = AuditEvent.objects.get(action="move_version")
    assert (event.run_id, event.actor, event.reason) == (fresh.pk, "sam", "v1 retired")
    assert drive(fresh, clock).state == RunState.COMPLETED
    assert receivers.counts()["task"] == 2  # the moved run's one, and the stranded run's (made before)


@pytest.mark.parametrize(
    "args, message",
    [
        (("--move",), "--move needs --reason and --as (the supervisor who moves the runs)"),
        (("--move", "--reason", "x", "--as", "nobody"), "no active user 'nobody'"),
        (("--move", "--reason", "x", "--as", "olga"), "olga may not move runs: that needs the supervisor role"),
        (("--dry-run",), "--dry-run, --reason and --as go with --move"),
    ],
)
def test_check_deploy_refuses_bad_arguments_in_one_line_and_moves_nothing(undeploy, args, message):
    person("olga", "operator")
    run = v1_run("x")
    undeploy("test_versioned", 1)
    assert check_deploy(*args)[1] == message
    assert WorkflowRun.objects.get(pk=run.pk).workflow_version == 1


@pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])  # check reads every model's database
def test_manage_py_check_warns_about_stranded_runs_when_given_the_database(undeploy):
    v1_run("w")
    undeploy("test_versioned", 1)
    out = StringIO()
    call_command("check", "--database", "default", stdout=out, stderr=out)
    assert "recovery.W010" in out.getvalue()
    assert "1 unfinished run(s) need a workflow version this code lacks (test_versioned v1: 1)" in out.getvalue()
    plain = StringIO()
    call_command("check", stdout=plain, stderr=plain)
    assert "recovery.W010" not in plain.getvalue()
