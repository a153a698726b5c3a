"""The console and versions (issue 32): a run whose version is not deployed says so; a supervisor
sees, per registered version, whether a move would continue the run, and moves it through the
same transition and checks as ``recover move_version``; bad input is a 400 that changes nothing."""

import html

import pytest
from django.urls import reverse

from recovery.engine.executor import advance
from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunState, StepState, WorkflowRun
from recovery.workflow import get_workflow
from tests.support import receivers
from tests.support.console import act, login
from tests.support.engine import drive

pytestmark = pytest.mark.django_db(transaction=True)


def v1_run(order_id: str):
    return run_start(workflow=get_workflow("test_versioned", 1), data={"tenant": "t", "order_id": order_id})[0]


def page(client, run) -> str:
    response = client.get(reverse("console:run", args=[run.workflow_id]))
    assert response.status_code == 200
    return html.unescape(response.content.decode())


def test_a_stranded_run_says_its_version_is_gone_and_a_supervisor_sees_where_it_can_move(clock, undeploy):
    run = v1_run("c-1")
    undeploy("test_versioned", 1)
    supervisor, operator = login("supervisor"), login("operator")
    text = page(supervisor, run)
    assert "test_versioned v1" in text
    assert "started under test_versioned v1; this deployment has v2: deploy v1 again, or move the run" in text
    assert 'data-action="move_version"' in text
    assert "v2: can move to v2 (adds check)" in text
    assert "test_versioned v1 is not deployed here: this deployment does not know its contract." in text
    assert 'data-action="move_version"' not in page(operator, run)
    assert "move to another version" in page(operator, run)  # "a higher role could also"

    listed = html.unescape(supervisor.get(reverse("console:runs")).content.decode())
    assert "test_versioned v1" in listed


def test_a_supervisor_moves_a_run_from_the_console_and_it_completes_on_the_new_version(clock):
    run = v1_run("c-2")
    response = act(login("supervisor"), run, "move_version", to_version="2", reason="v1 goes tonight")
    assert response.status_code == 200
    run.refresh_from_db()
    assert run.workflow_version == 2
    event = AuditEvent.objects.get(run=run, action="move_version")
    assert event.reason == "v1 goes tonight" and event.actor == "u-supervisor"
    assert drive(run, clock).state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 0, "ledger": 1, "model_call": 0}


@pytest.mark.parametrize(
    "to_version, message",
    [("", "needs the version"), ("x", "whole number"), ("9", "v9 is not deployed here")],
)
def test_a_bad_version_from_the_console_is_a_400_and_changes_nothing(clock, to_version, message):
    run = v1_run("c-3")
    response = act(login("supervisor"), run, "move_version", to_version=to_version)
    assert response.status_code == 400 and message in html.unescape(response.content.decode())
    run.refresh_from_db()
    assert run.workflow_version == 1 and not AuditEvent.objects.filter(run=run, action="move_version").exists()


def test_the_console_refuses_a_move_the_target_cannot_continue_and_names_the_step(clock):
    receivers.arm("ledger", "rate_limit")
    run = v1_run("c-4")
    advance(run.pk)
    run.refresh_from_db()
    assert run.steps.get(step_name="create_task").state == StepState.SUCCEEDED
    supervisor = login("supervisor")
    assert "v2: cannot move to v2: create_task is step 2 of this run and step 3 of v2" in page(supervisor, run)
    response = act(supervisor, run, "move_version", to_version="2")
    assert response.status_code == 400 and "create_task is step 2" in html.unescape(response.content.decode())
    assert WorkflowRun.objects.get(pk=run.pk).workflow_version == 1


def test_the_move_asks_whether_effects_stand_only_where_a_target_rekeys_a_finished_step(clock, monkeypatch):
    from dataclasses import replace

    from recovery import registry

    receivers.arm("ledger", "rate_limit")
    run = run_start(workflow="test_versioned", data={"tenant": "t", "order_id": "c-5"})[0]  # v2
    advance(run.pk)  # its task made
    run.refresh_from_db()
    supervisor = login("supervisor")
    assert 'name="effects_stand"' not in page(supervisor, run)  # v1 cannot take it; nothing to ask

    monkeypatch.setitem(registry._REGISTRY, "test_versioned", dict(registry._REGISTRY["test_versioned"]))
    v3 = get_workflow("test_versioned").derive(version=3)
    v3.steps[2] = replace(v3.steps[2], key_version=2)  # create_task: a changed business action
    text = page(supervisor, run)
    assert "v3: can move to v3 (effects made under an old key: create_task)" in text
    assert 'name="effects_stand"' in text
    refused = act(supervisor, run, "move_version", to_version="3")
    assert refused.status_code == 400 and "say whether that effect stands" in html.unescape(refused.content.decode())
    moved = act(supervisor, run, "move_version", to_version="3", effects_stand="on")
    assert moved.status_code == 200 and WorkflowRun.objects.get(pk=run.pk).workflow_version == 3
