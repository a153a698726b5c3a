"""The dashboard shows the numbers /metrics serves: the same gauges, the same counters."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

from recovery.engine.transitions import perform, run_start
from recovery.models import RunState, WorkflowRun
from tests.support import receivers
from tests.support.console import login
from tests.support.engine import drive, person

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "test-metrics-token-0123456789"  # config/test_settings.py


def scraped() -> dict[str, list]:
    text = Client().get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).content.decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_the_dashboard_shows_what_a_scrape_reads(clock):
    receivers.arm("task", "fail_before_commit")  # a retry
    receivers.arm("message", "commit_then_drop")  # an unknown outcome, found by look-up
    drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "ok"})[0], clock)
    receivers.arm("ledger", "unavailable", times=10)
    stuck = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "stuck"})[0], clock)
    assert stuck.state == RunState.NEEDS_REVIEW
    perform(
        "retry", workflow_id=stuck.workflow_id, step_name="post_entry", actor=person("olga", "operator"), reason="x"
    )

    page = login("viewer").get("/dashboard")
    assert page.status_code == 200
    context, metrics = page.context, scraped()
    column = context["workflows"].index("test_orders")

    runs = {s.labels["state"]: s.value for s in metrics["recovery_runs"] if s.labels["workflow"] == "test_orders"}
    stuck_runs = {
        s.labels["cause"]: s.value for s in metrics["recovery_stuck_runs"] if s.labels["workflow"] == "test_orders"
    }
    shown = {row["label"]: row["cells"][column][0] for row in context["by_workflow"]}
    assert [shown[state.label] for state in RunState] == [runs[state.value] for state in RunState]
    assert shown["Retries exhausted"] == stuck_runs["exhausted"]
    assert runs["completed"] == 1 and runs["waiting"] + runs["pending"] == 1  # the retried run goes on

    def counter(name: str, **labels: str) -> float:
        return sum(
            s.value
            for s in metrics[name]
            if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items())
        )

    engine = {row["label"]: row["cells"][column] for row in context["engine"]["rows"]}
    attempts = "recovery_step_attempts"
    assert engine["Attempts that failed"] == counter(attempts, workflow="test_orders", outcome="failed") >= 5
    assert engine["Attempts that succeeded"] == counter(attempts, workflow="test_orders", outcome="succeeded")
    assert engine["Attempts with an unknown outcome"] == counter(attempts, workflow="test_orders", outcome="unknown")
    assert engine["Look-ups: it happened"] == counter("recovery_reconciles", workflow="test_orders", result="happened")
    assert engine["Attempts with an unknown outcome"] >= 1 and engine["Look-ups: it happened"] >= 1
    # (counters live as long as the process: earlier tests' actions are in both alike)
    actions = sorted(
        (s.labels["action"], s.labels["role"], s.value)
        for s in metrics["recovery_operator_actions"]
        if s.name.endswith("_total")
    )
    assert [(a["action"], a["role"], a["count"]) for a in context["engine"]["actions"]] == actions
    assert ("retry", "operator") in {(a, r) for a, r, _ in actions}
    assert "By workflow" in page.text and "Since the engine" in page.text


def test_runs_of_a_workflow_no_longer_registered_have_their_column_and_filter(clock):
    receivers.arm("ledger", "unavailable", times=10)
    stuck = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "old"})[0], clock)
    WorkflowRun.objects.filter(pk=stuck.pk).update(workflow_name="test_orders_retired")  # a deploy renamed it

    viewer = login("viewer")
    page = viewer.get("/dashboard")
    assert page.context["workflows"][-1] == "test_orders_retired"
    assert page.context["unregistered"] == {"test_orders_retired"}
    assert 'test_orders_retired <span class="sub">(not registered)</span>' in page.text
    column = page.context["workflows"].index("test_orders_retired")
    shown = {row["label"]: row["cells"][column][0] for row in page.context["by_workflow"]}
    retired = {
        s.labels["state"]: s.value for s in scraped()["recovery_runs"] if s.labels["workflow"] == "test_orders_retired"
    }
    assert shown["Needs review"] == retired["needs_review"] == 1
    assert shown["Retries exhausted"] == 1

    runs = viewer.get(reverse("console:runs"))
    assert '<option value="test_orders_retired">test_orders_retired (not registered)</option>' in runs.text
    assert '<option value="test_orders">test_orders</option>' in runs.text
    listed = viewer.get(reverse("console:runs") + "?workflow=test_orders_retired")
    assert [r.workflow_id for r in listed.context["runs"]] == [stuck.workflow_id]
    assert '<option value="test_orders_retired" selected>' in listed.text
