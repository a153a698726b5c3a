"""The runs list as an on-call operator uses it (issue 33): the Business key filter takes what
the run page shows, the search finds a step's error text, the list sorts by its columns with a
total count, a bulk dry run says what each run is and what stays made, and the dashboard lists
the snoozed alerts."""

import pytest
from django.urls import reverse

from recovery.console import selectors
from recovery.engine.transitions import run_start
from recovery.models import StepExecution, WorkflowRun
from tests.support.console import failed_run, login

pytestmark = pytest.mark.django_db(transaction=True)


def listed(client, **params) -> list[str]:
    response = client.get(reverse("console:runs"), params)
    assert response.status_code == 200
    return [run.workflow_id for run in response.context["runs"]]


def start(tenant: str, order_id: str) -> WorkflowRun:
    return WorkflowRun.objects.get(
        workflow_id=run_start(workflow="test_orders", data={"tenant": tenant, "order_id": order_id})[0]
    )


# --- 1. the Business key filter ---------------------------------------------------------


def test_the_business_key_filter_finds_the_key_the_run_page_shows_in_any_case(clock):
    wanted = start("acme", "INV-1002")
    start("acme", "INV-2001")
    start("globex", "acme-1")  # "acme" inside its business key, but not at its beginning
    viewer = login("viewer")
    page = viewer.get(reverse("console:run", args=[wanted.workflow_id]))
    assert wanted.business_key == "acme:INV-1002" and "acme:INV-1002" in page.text

    assert listed(viewer, key="acme:INV-1002") == ["order:acme:INV-1002"]
    assert listed(viewer, key="ACME:inv-1002") == ["order:acme:INV-1002"]
    assert listed(viewer, key="acme:inv-100") == ["order:acme:INV-1002"]  # the beginning of a key
    assert set(listed(viewer, key="Acme")) == {"order:acme:INV-1002", "order:acme:INV-2001"}
    # The beginning of the workflow id, as before, in any case too.
    assert set(listed(viewer, key="ORDER:acme:")) == {"order:acme:INV-1002", "order:acme:INV-2001"}
    assert listed(viewer, key="acme:INV-1003") == []
    assert listed(viewer, key="1002") == []  # a key is matched from its beginning only


# --- 2. error text is searchable --------------------------------------------------------


def test_the_search_finds_a_run_by_its_steps_error_text_from_three_characters(clock):
    failing = failed_run(clock, "f-1")  # the tracker refused: the step's last_error says so
    start("t", "other")
    error = failing.steps.get(step_name="create_task").last_error
    assert "forbidden" in error.lower()
    StepExecution.objects.filter(run=failing, step_name="create_task").update(last_error="HTTP 503 from the tracker")
    viewer = login("viewer")
    assert listed(viewer, q="HTTP 503") == [failing.workflow_id]
    assert listed(viewer, q="http 503") == [failing.workflow_id]  # any case
    assert listed(viewer, q="tracker") == [failing.workflow_id]
    assert listed(viewer, q="no such error") == []
    # Two characters do not search the errors (they would match most of them).
    assert listed(viewer, q="TP") == []
    assert selectors.RunFilters(q="HTTP 503").queryset(clock.now()).get() == failing
