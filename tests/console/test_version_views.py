"""The console shows versions (issue 32): the runs list filters by workflow version, the dashboard
says per version how many runs are in flight and whether the version may leave the code, and the
bulk form moves many runs to another version, a dry run first, through the same judgement
(versions.move_plan) and transition (run_move_version) as the run page and ``recover``."""

import html
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from recovery.engine.executor import advance
from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunState, StepExecution, StepState, WorkflowRun
from recovery.workflow import get_workflow
from tests.support import receivers
from tests.support.console import login

pytestmark = pytest.mark.django_db(transaction=True)


def run_on(version: int, order_id: str) -> WorkflowRun:
    workflow = get_workflow("test_versioned", version)
    return run_start(workflow=workflow, data={"tenant": "t", "order_id": order_id})[0]


def text_of(response) -> str:
    return html.unescape(response.content.decode())


def listed(client, query: str) -> set[str]:
    response = client.get(reverse("console:runs") + query)
    assert response.status_code == 200
    return {run.workflow_id for run in response.context["runs"]}


# --- the runs list ----------------------------------------------------------------------


def test_the_version_filter_lists_only_the_runs_of_that_version(clock):
    old = [run_on(1, "f-1"), run_on(1, "f-2")]
    new = run_on(2, "f-3")
    viewer = login("viewer")
    v1 = {r.workflow_id for r in old}
    assert listed(viewer, "?workflow=test_versioned&version=1") == v1
    assert listed(viewer, "?workflow=test_versioned&version=v1") == v1  # as the console writes it
    assert listed(viewer, "?workflow=test_versioned&version=2") == {new.workflow_id}
    assert listed(viewer, "?version=1") == v1  # of any workflow
    page = text_of(viewer.get(reverse("console:runs") + "?workflow=test_versioned&version=1"))
    assert '<option value="1" selected>v1</option><option value="2">v2 (current)</option>' in page
    assert "No run" not in page
    empty = text_of(viewer.get(reverse("console:runs") + "?workflow=test_versioned&version=7"))
    assert "No run of test_versioned v7." in empty and '<option value="7" selected>v7</option>' in empty


@pytest.mark.parametrize("bad", ["x", "-1", "1.5", "²", "1" * 12, ""])
def test_a_bad_version_in_the_url_is_ignored_like_other_bad_filter_values(clock, bad):
    runs = {run_on(1, "b-1").workflow_id, run_on(2, "b-2").workflow_id}
    response = login("viewer").get(reverse("console:runs"), {"workflow": "test_versioned", "version": bad})
    assert response.status_code == 200 and response.context["filters"].version is None
    assert {r.workflow_id for r in response.context["runs"]} == runs


def test_the_version_filter_offers_a_version_in_flight_runs_have_and_this_deployment_lacks(clock, undeploy):
    stranded = run_on(1, "s-1")
    undeploy("test_versioned", 1)
    viewer = login("viewer")
    page = text_of(viewer.get(reverse("console:runs") + "?workflow=test_versioned"))
    assert '<option value="1">v1 (not deployed)</option><option value="2">v2 (current)</option>' in page
    assert listed(viewer, "?workflow=test_versioned&version=1") == {stranded.workflow_id}


# --- the dashboard ----------------------------------------------------------------------


def version_lines(client) -> dict[str, str]:
    page = text_of(client.get(reverse("console:dashboard")))
    found = re.findall(r'<dd class="version-(\w+)" data-version="([^"]+)" data-runs="\d+">([^<]*)', page)
    return {name: f"{kind}: {text.strip()}" for kind, name, text in found}


def test_the_dashboard_counts_runs_in_flight_per_version_with_the_oldest(clock):
    run_on(1, "d-1")
    clock.advance(3 * 3600)
    run_on(1, "d-2")
    for i in range(3):
        run_on(2, f"d-new-{i}")
    finished = run_on(1, "d-done")
    WorkflowRun.objects.filter(pk=finished.pk).update(state=RunState.COMPLETED)  # not in flight: not counted
    clock.advance(60)
    lines = version_lines(login("viewer"))
    assert lines["test_versioned v1"] == "draining: v1: 2 in flight, oldest 3 h 1 min; safe to remove at 0"
    assert lines["test_versioned v2"] == "current: v2 (current): 3 in flight, oldest 60 s"


def test_the_dashboard_says_a_version_no_run_needs_is_safe_to_remove_but_never_the_current_one(clock):
    run_on(1, "r-1")
    WorkflowRun.objects.update(state=RunState.TERMINATED)
    lines = version_lines(login("viewer"))
    assert lines["test_versioned v1"] == "removable: v1: none in flight; safe to remove"
    assert lines["test_versioned v2"] == "current: v2 (current): none in flight"


def test_the_dashboard_marks_a_version_runs_need_and_this_deployment_lacks_as_not_deployed(clock, undeploy):
    for i in range(2):
        run_on(1, f"n-{i}")
    undeploy("test_versioned", 1)
    clock.advance(90)
    viewer = login("viewer")
    assert version_lines(viewer)["test_versioned v1"] == (
        "stranded: v1 (not deployed): 2 in flight, oldest 90 s; stranded: deploy it again, or move them to a "
        "deployed version"
    )
    page = text_of(viewer.get(reverse("console:dashboard")))
    assert f"{reverse('console:runs')}?workflow=test_versioned&version=1" in page  # "list them"


# --- bulk move --------------------------------------------------------------------------


def begun_v1_run(order_id: str) -> WorkflowRun:
    """A v1 run whose task was created (step 2 of v1, step 3 of v2): v2 cannot continue it."""
    receivers.arm("ledger", "rate_limit")
    run = run_on(1, order_id)
    advance(run.pk)
    run.refresh_from_db()
    assert run.steps.get(step_name="create_task").state == StepState.SUCCEEDED
    return run


def bulk(client, **data):
    return client.post(reverse("console:bulk"), data)


def confirm(client, preview):
    """Post the dry run page's confirmation form as it is."""
    form = preview.text.split('class="bulk-confirm"')[1].split("</form>")[0]
    data: dict[str, list[str]] = {}
    for name, value in re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', form):
        data.setdefault(name, []).append(html.unescape(value))
    return client.post(reverse("console:bulk"), data)


def snapshot() -> tuple:
    """What a refused or dry-run move must leave as it was: every run's version, state and
    steps, and the audit trail."""
    runs = sorted(WorkflowRun.objects.values_list("workflow_id", "workflow_version", "state"))
    steps = sorted(StepExecution.objects.values_list("run_id", "step_name", "position", "key_version", "state"))
    return runs, steps, AuditEvent.objects.count()


def test_only_a_supervisor_is_offered_the_bulk_move_and_an_operator_s_is_refused_unchanged(clock):
    run = run_on(1, "p-1")

    def bulk_form(client) -> str:
        return client.get(reverse("console:runs")).text.split('id="bulk-actions"')[1].split("</fieldset>")[0]

    form = bulk_form(login("supervisor"))
    assert '<option value="move_version">Move to another version</option>' in form
    assert re.search(r'<option value="2">v2: [^<]*test_versioned[^<]*</option>', form)  # a target version
    operator = login("operator")
    form = bulk_form(operator)
    assert "move_version" not in form and 'name="to_version"' not in form
    before = snapshot()
    data = {"action": "move_version", "to_version": "2", "reason": "r", "run": [run.workflow_id]}
    assert bulk(operator, **data).status_code == 403
    assert bulk(operator, **data, confirm="yes").status_code == 403
    assert snapshot() == before


@pytest.mark.parametrize("to_version, message", [("", "choose the version to move the runs to"), ("x", "whole number")])
def test_a_bulk_move_without_a_version_is_a_400_and_changes_nothing(clock, to_version, message):
    run = run_on(1, "m-1")
    supervisor = login("supervisor")
    before = snapshot()
    data = {"action": "move_version", "to_version": to_version, "reason": "r", "run": [run.workflow_id]}
    for extra in ({}, {"confirm": "yes"}):  # the dry run, and a confirmation posted without one
        response = bulk(supervisor, **data, **extra)
        assert response.status_code == 400 and message in text_of(response)
    assert snapshot() == before


def test_the_bulk_move_dry_run_says_per_run_whether_it_can_move_and_writes_nothing(clock):
    fresh = [run_on(1, "dry-1"), run_on(1, "dry-2")]
    begun = begun_v1_run("dry-3")
    already = run_on(2, "dry-4")
    finished = run_on(1, "dry-5")
    WorkflowRun.objects.filter(pk=finished.pk).update(state=RunState.COMPLETED)
    ids = [r.workflow_id for r in [*fresh, begun, already, finished]]
    before = snapshot()

    preview = bulk(login("supervisor"), action="move_version", to_version="2", reason="v1 goes", run=ids)
    assert preview.status_code == 200
    text = text_of(preview)
    assert "Dry run: nothing has changed yet. 2 of 5 selected runs would be changed (move to v2" in re.sub(
        r"</?b>", "", text
    )
    result = preview.context["result"]
    assert result.done == [r.workflow_id for r in fresh]
    assert result.notes == {r.workflow_id: "can move to v2 (adds check)" for r in fresh}
    refused = dict(result.refused)
    assert refused[begun.workflow_id] == (
        "cannot move to v2: create_task is step 2 of this run and step 3 of v2: the steps before it differ"
    )
    assert refused[already.workflow_id] == "cannot move to v2: the run is on v2 already"
    assert "a finished run is not moved" in refused[finished.workflow_id]
    for why in refused.values():
        assert why in text
    assert "Move these 2 runs to v2" in text and '<input type="hidden" name="to_version" value="2">' in text
    assert snapshot() == before  # a dry run writes nothing


def test_the_bulk_move_dry_run_reads_as_many_queries_for_many_runs_as_for_one(clock):
    runs = [run_on(1, f"q-{i}") for i in range(6)]
    supervisor = login("supervisor")
    supervisor.get(reverse("console:runs"))  # the session and the role read once before measuring

    def queries(ids):
        with CaptureQueriesContext(connection) as captured:
            response = bulk(supervisor, action="move_version", to_version="2", reason="r", run=ids)
        assert response.status_code == 200 and len(response.context["result"].done) == len(ids)
        return len(captured)

    assert queries([runs[0].workflow_id]) == queries([r.workflow_id for r in runs])


def test_a_confirmed_bulk_move_moves_the_runs_v2_can_continue_and_lists_the_refused_one_unchanged(clock):
    fresh = [run_on(1, "go-1"), run_on(1, "go-2")]
    begun = begun_v1_run("go-3")
    begun_steps = sorted(begun.steps.values_list("step_name", "position", "key_version", "state"))
    supervisor = login("supervisor")
    ids = [r.workflow_id for r in [*fresh, begun]]
    preview = bulk(supervisor, action="move_version", to_version="2", reason="v1 goes tonight", run=ids)
    assert preview.context["result"].done == [r.workflow_id for r in fresh]

    # Confirmed with the refused run too (a forged confirmation): the transition judges again.
    response = bulk(supervisor, action="move_version", to_version="2", reason="v1 goes tonight", run=ids, confirm="yes")
    assert response.status_code == 200
    text = text_of(response)
    assert "2 runs changed, each with its own audit event." in text
    assert "Left untouched (1)" in text and "create_task is step 2 of this run and step 3 of v2" in text
    for run in fresh:
        run.refresh_from_db()
        assert run.workflow_version == 2 and run.state == RunState.PENDING
        assert list(run.steps.order_by("position").values_list("step_name", flat=True)) == [
            "read",
            "check",
            "create_task",
            "post_entry",
        ]
        event = AuditEvent.objects.get(run=run, action="move_version")
        assert event.reason == "v1 goes tonight" and event.actor == "u-supervisor"
        assert event.before["version"] == 1 and event.after["version"] == 2
    begun.refresh_from_db()
    assert begun.workflow_version == 1
    assert sorted(begun.steps.values_list("step_name", "position", "key_version", "state")) == begun_steps
    assert not AuditEvent.objects.filter(run=begun, action="move_version").exists()


def test_the_bulk_move_confirmation_applies_what_the_dry_run_showed(clock):
    runs = [run_on(1, "c-1"), run_on(1, "c-2")]
    supervisor = login("supervisor")
    preview = bulk(
        supervisor, action="move_version", to_version="2", reason="drain v1", run=[r.workflow_id for r in runs]
    )
    response = confirm(supervisor, preview)
    assert "2 runs changed" in text_of(response)
    assert set(WorkflowRun.objects.values_list("workflow_version", flat=True)) == {2}
    assert AuditEvent.objects.filter(action="move_version", reason="drain v1").count() == 2
