"""States that agree (issue 33): a run held because an operator stopped its agent is counted,
listed and explained as "Agent stopped" — never as retries exhausted; the steps table and the
conversation read one state (recovery.console.labels), an agent's parent step shows its turn,
a next attempt in the past is never shown; a finished run's page drops its alert banner; the
runs list, its state filter and its counts agree on "partly compensated". SPEC.md §4 (the
console tells an operator what is true)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

from recovery import clock as engine_clock
from recovery import counts, why
from recovery.console import labels
from recovery.engine.executor import advance
from recovery.engine.transitions import agent_stop, alert_raise, perform, run_compensate, run_start, run_version
from recovery.models import RunState, StepState, WorkflowRun
from tests.support import receivers
from tests.support.console import login
from tests.support.engine import drive, person

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])

TOKEN = "test-metrics-token-0123456789"  # config/test_settings.py


def waiting_agent(order_id: str) -> WorkflowRun:
    """An agent whose credit note failed once (503): the run waits in turn 2 for the retry."""
    receivers.arm("ledger", "unavailable")
    run = run_start(workflow="test_agent", data={"tenant": "t", "order_id": order_id})[0]
    advance(run.pk)
    run.refresh_from_db()
    assert run.state == RunState.WAITING
    return run


def stopped_agent(order_id: str, clock) -> WorkflowRun:
    """The same, stopped by a supervisor long after its retry was due (the demo's D-503)."""
    run = waiting_agent(order_id)
    clock.advance(17 * 60)
    return agent_stop(
        workflow_id=run.workflow_id,
        step_name="resolve",
        actor=person("olga", "supervisor"),
        reason="the customer called",
    )


def page(client, run) -> str:
    return client.get(reverse("console:run", args=[run.workflow_id])).content.decode()


def row(html: str, attribute: str, name: str) -> str:
    return html.split(f'{attribute}="{name}"')[1].split("</tr>")[0]


def listed(html: str, run: WorkflowRun) -> str:
    return html.split(f">{run.workflow_id}</a>")[1].split("</tr>")[0]


def stuck(cause: str) -> int:
    return next(c["count"] for c in counts.stuck_counts(now=engine_clock.now()) if c["cause"] == cause)


def test_a_run_whose_agent_was_stopped_is_counted_listed_and_scraped_as_agent_stopped_only(clock):
    run = stopped_agent("count", clock)
    assert run.state == RunState.NEEDS_REVIEW
    assert run.steps.get(step_name="resolve:2:0:credit").state == StepState.FAILED  # its retry was due
    assert stuck("agent_stopped") == 1
    assert stuck("exhausted") == stuck("policy_refused") == stuck("model_output") == 0
    assert counts.STUCK_LABELS["agent_stopped"] == "Agent stopped"

    viewer = login("viewer")
    listed = viewer.get(reverse("console:runs"), {"stuck": "agent_stopped"})
    assert [r.workflow_id for r in listed.context["runs"]] == [run.workflow_id]
    assert viewer.get(reverse("console:runs"), {"stuck": "exhausted"}).context["runs"] == []
    chips = viewer.get(reverse("console:runs"), headers={"HX-Request": "true", "HX-Target": "counts"})
    assert 'href="?stuck=agent_stopped">Agent stopped <b>1</b>' in chips.content.decode()

    dashboard = viewer.get("/dashboard").context
    column = dashboard["workflows"].index("test_agent")
    shown = {r["label"]: r["cells"][column][0] for r in dashboard["by_workflow"]}
    text = viewer.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).content.decode()
    scraped = {
        s.labels["cause"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "recovery_stuck_runs"
        for s in f.samples
        if s.labels["workflow"] == "test_agent"
    }
    assert shown["Agent stopped"] == scraped["agent_stopped"] == 1
    assert shown["Retries exhausted"] == scraped["exhausted"] == 0


def test_the_why_sentence_says_who_stopped_the_agent_when_and_the_two_ways_on(clock):
    run = stopped_agent("why", clock)
    at = run.steps.get(step_name="resolve").updated_at
    expected = (
        f"agent resolve stopped by olga at {at:%H:%M:%S} UTC (the customer called): "
        "resume to let it go on, or fork it from a turn"
    )
    assert why.why_not_moving(run, list(run.steps.all()), now=clock.now()) == expected
    html = page(login("viewer"), run)
    assert expected in html
    listed = [r for r in login("operator").get(reverse("console:runs")).context["runs"] if r.pk == run.pk]
    assert listed[0].why == expected


def test_a_stopped_agent_s_steps_table_and_conversation_agree_and_show_no_past_next_attempt(clock):
    run = stopped_agent("agree", clock)
    credit = run.steps.get(step_name="resolve:2:0:credit")
    assert credit.next_attempt_at < clock.now()  # what the row still records: never shown
    html = page(login("viewer"), run)

    in_table = row(html, "data-step", "resolve:2:0:credit")
    in_conversation = row(html, "data-call", "resolve:2:0:credit")
    for cell in (in_table, in_conversation):
        assert '<span class="state step-failed" data-state>Failed</span>' in cell
    shown = html.split('id="run-steps"')[1].split("<h2>Timeline")[0]  # the steps table and the conversation
    assert "Retrying" not in shown and f"{credit.next_attempt_at:%H:%M:%S}" not in shown
    assert "<td data-next>—</td>" in in_table

    parent = row(html, "data-step", "resolve")
    assert "Stopped at turn 2 of at most 5" in parent and "2 turns, 3 calls" in parent
    assert "Pending" not in parent


def test_a_moving_agent_s_parent_step_shows_its_turn_and_a_due_retry_reads_due_now(clock):
    run = waiting_agent("turn")
    credit = run.steps.get(step_name="resolve:2:0:credit")
    viewer = login("viewer")
    html = page(viewer, run)
    retry_at = f"{credit.next_attempt_at:%H:%M:%S} UTC"
    parent = row(html, "data-step", "resolve")
    assert f"Turn 2 of at most 5: waiting to call credit again at {retry_at}" in parent
    assert "2 turns, 3 calls" in parent and "Pending" not in parent
    for cell in (row(html, "data-step", "resolve:2:0:credit"), row(html, "data-call", "resolve:2:0:credit")):
        assert f"Retrying at {retry_at}" in cell

    clock.advance(600)  # the retry is due, and no executor has taken the run yet
    html = page(viewer, run)
    assert retry_at not in html.split('id="run-steps"')[1].split("<h2>Timeline")[0]
    for cell in (row(html, "data-step", "resolve:2:0:credit"), row(html, "data-call", "resolve:2:0:credit")):
        assert "Retrying due now, waiting for an executor" in cell
    assert "<td data-next>due now</td>" in row(html, "data-step", "resolve:2:0:credit")
    assert "Turn 2 of at most 5: waiting to call credit again due now" in row(html, "data-step", "resolve")


def test_one_label_function_decides_a_row_s_state_for_every_kind_of_run(clock):
    run = waiting_agent("labels")
    now = clock.now()
    credit = run.steps.get(step_name="resolve:2:0:credit")
    future = labels.step_label(credit, run=run, now=now)
    assert future.text == f"Retrying at {credit.next_attempt_at:%H:%M:%S} UTC" and future.css == "step-retrying"
    assert future.next == f"{credit.next_attempt_at:%H:%M:%S} UTC"
    due = labels.step_label(credit, run=run, now=now + timedelta(hours=1))
    assert (due.text, due.next) == ("Retrying due now, waiting for an executor", "due now")
    run.state = RunState.NEEDS_REVIEW  # held: no next attempt, whatever the row records
    held = labels.step_label(credit, run=run, now=now)
    assert (held.text, held.css, held.next) == ("Failed", "step-failed", "—")


def test_a_finished_run_s_live_page_drops_the_alert_banner_of_its_stuck_episode(clock):
    receivers.arm("ledger", "unavailable", times=10)
    run = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "alert"})[0], clock)
    assert run.state == RunState.NEEDS_REVIEW
    receivers.clear()  # the ledger is back
    assert alert_raise(run_pk=run.pk, cause="exhausted", revision=run.revision, why="stuck", channels=[])
    viewer = login("viewer")
    assert 'data-alert="exhausted"' in page(viewer, run)
    shown = run_version(run)

    perform("retry", workflow_id=run.workflow_id, step_name="post_entry", actor=person("olga", "operator"), reason="x")
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED  # no sweep has run: the alert row is still open
    assert run.alerts.get().state != "resolved"
    headers = {"HX-Request": "true", "HX-Target": "run-poll"}
    live = viewer.get(reverse("console:run", args=[run.workflow_id]), {"live": "1", "shown": shown}, headers=headers)
    body = live.content.decode()
    assert live.status_code == 286 and 'id="run-head"' in body  # the last poll swaps the head
    assert "data-alert" not in body and "Alert firing" not in body
    assert "data-alert" not in page(viewer, run)


def test_the_runs_list_its_state_filter_and_its_counts_agree_on_partly_compensated(clock):
    partly = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "partly"})[0], clock)
    run_compensate(workflow_id=partly.workflow_id, step_name="post_entry", actor=None, reason="undo the entry")
    partly = drive(partly, clock)
    plain = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "plain"})[0], clock)
    assert partly.state == plain.state == RunState.COMPLETED

    viewer = login("viewer")
    html = viewer.get(reverse("console:runs")).content.decode()
    assert listed(html, partly).count("Completed, partly compensated") == 1
    assert "partly compensated" not in listed(html, plain)

    only = viewer.get(reverse("console:runs"), {"state": "partly_compensated"})
    assert [r.workflow_id for r in only.context["runs"]] == [partly.workflow_id]
    completed = viewer.get(reverse("console:runs"), {"state": "completed"})
    assert {r.workflow_id for r in completed.context["runs"]} == {partly.workflow_id, plain.workflow_id}
    chips = viewer.get(reverse("console:runs"), headers={"HX-Request": "true", "HX-Target": "counts"})
    text = chips.content.decode()
    assert "&amp;state=partly_compensated" in text and "Completed, partly compensated <b>1</b>" in text
    assert "Completed <b>2</b>" in text
    assert '<option value="partly_compensated">Completed, partly compensated</option>' in html


def test_the_run_head_shows_a_wake_up_only_while_the_run_moves_and_never_in_the_past(clock):
    run = waiting_agent("wake")
    viewer = login("viewer")
    wake = f"{run.next_wake_at:%Y-%m-%d %H:%M:%S} UTC"
    assert f"<dd data-wake>{wake}</dd>" in page(viewer, run)
    clock.advance(600)
    assert "<dd data-wake>due now</dd>" in page(viewer, run)
    WorkflowRun.objects.filter(pk=run.pk).update(state=RunState.NEEDS_REVIEW)  # held: it wakes by no one
    assert "<dd data-wake>—</dd>" in page(viewer, run)


def test_a_finished_agent_s_parent_step_counts_its_turns_and_calls_not_zero_attempts(clock):
    run = drive(run_start(workflow="test_agent", data={"tenant": "t", "order_id": "done"})[0], clock)
    assert run.state == RunState.COMPLETED
    parent = row(page(login("viewer"), run), "data-step", "resolve")
    assert '<span class="state step-succeeded" data-state>Succeeded</span>' in parent
    assert "<td>3 turns, 3 calls</td>" in parent


@pytest.mark.django_db(transaction=False)
def test_the_stuck_causes_are_one_vocabulary_found_by_one_query_each_in_its_order():
    """recovery.states.StuckCause names and labels them (the authors' API checks ``stuck_after``
    against it without importing a model); recovery.counts finds each, in the same order."""
    from django.db.models import Q

    from recovery.states import StuckCause
    from recovery.workflow import Workflow

    found = counts.stuck_causes(engine_clock.now())
    assert list(found) == list(StuckCause.values) == list(counts.STUCK_LABELS)
    assert all(label == StuckCause(cause).label and isinstance(q, Q) for cause, (label, q) in found.items())
    with pytest.raises(ValueError, match="no stuck cause stalled"):
        Workflow("probe", version=1, workflow_id=lambda i: "p", stuck_after={"stalled": timedelta(minutes=5)})
