"""The console shows versions (issue 32): the runs list filters by workflow version, and the
dashboard says per version how many runs are in flight and whether the version may leave the code."""

import html
import re

import pytest
from django.urls import reverse

from recovery.engine.transitions import run_start
from recovery.models import RunState, WorkflowRun
from recovery.workflow import get_workflow
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
