"""The console shows versions (issue 32): the runs list filters by workflow version, of one
workflow or of any."""

import html

import pytest
from django.urls import reverse

from recovery.engine.transitions import run_start
from recovery.models import WorkflowRun
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
