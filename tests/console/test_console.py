"""The operator console: every page needs a session, every action is checked on the server,
audited with the operator and a reason, and goes through the same transitions as the
executor."""

import re

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from recovery.engine.transitions import run_start, run_version
from recovery.models import AuditEvent, RunState, StepState, WorkflowRun
from tests.support import receivers
from tests.support.console import act, confirm, failed_run, login, unknown_run
from tests.support.engine import drive
from tests.support.models import RemoteObject

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    "name,args", [("console:runs", []), ("console:dashboard", []), ("demo", []), ("console:run", ["order:t:x"])]
)
def test_every_page_needs_a_session(name, args):
    response = Client().get(reverse(name, args=args))
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_a_user_without_a_role_sees_nothing():
    assert login(None).get(reverse("console:runs")).status_code == 403


def test_viewer_reads_the_list_and_the_run_but_gets_no_action_and_a_forged_post_is_refused(clock):
    run = failed_run(clock)
    viewer = login("viewer")
    page = viewer.get(reverse("console:runs"))
    assert page.status_code == 200 and run.workflow_id in page.text
    detail = viewer.get(reverse("console:run", args=[run.workflow_id]))
    assert detail.status_code == 200 and "data-action=" not in detail.text
    assert "needs the operator role" in detail.text
    events = AuditEvent.objects.count()
    forged = act(viewer, run, "retry", step="create_task")
    assert forged.status_code == 403
    run.refresh_from_db()
    assert run.state == RunState.FAILED and AuditEvent.objects.count() == events


def test_operator_retries_a_failed_step_with_a_reason_and_the_audit_names_them(clock):
    run = failed_run(clock)
    operator = login("operator")
    detail = operator.get(reverse("console:run", args=[run.workflow_id]))
    assert 'data-action="retry:create_task"' in detail.text
    assert 'data-action="terminate"' not in detail.text  # supervisors only
    response = act(operator, run, "retry", step="create_task", reason="tracker token rotated")
    assert response.status_code == 200 and 'id="run-body"' in response.text
    assert "retry (create_task) recorded" in response.text
    event = AuditEvent.objects.get(run=run, action="retry")
    assert (event.actor, event.reason) == ("u-operator", "tracker token rotated")
    version = response.context["versions"][0]  # the run's saved versions name the operator too
    assert (version.history_user.get_username(), version.state) == ("u-operator", RunState.PENDING)
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}


def test_an_action_without_a_reason_changes_nothing_and_says_why(clock):
    run = failed_run(clock)
    response = act(login("operator"), run, "retry", step="create_task", reason="  ")
    assert response.status_code == 400 and "reason is required" in response.text
    assert response["HX-Retarget"] == "#flash"
    assert not AuditEvent.objects.filter(action="retry").exists()


def test_two_operators_acting_on_the_same_page_make_one_transition_the_other_gets_409(clock):
    run = failed_run(clock)
    version = run_version(run)
    first, second = login("operator"), login("supervisor")
    assert act(first, run, "retry", step="create_task", version=version).status_code == 200
    late = act(second, run, "terminate", version=version)
    assert late.status_code == 409 and "reload" in late.text
    run.refresh_from_db()
    assert run.state == RunState.PENDING
    assert AuditEvent.objects.filter(action__in=["retry", "terminate"]).count() == 1


def test_operator_may_not_terminate_supervisor_may_after_confirmation(clock):
    run = failed_run(clock)
    assert act(login("operator"), run, "terminate").status_code == 403
    supervisor = login("supervisor")
    assert 'hx-confirm="Stop this run for good?' in supervisor.get(reverse("console:run", args=[run.workflow_id])).text
    assert act(supervisor, run, "terminate").status_code == 200
    run.refresh_from_db()
    assert run.state == RunState.TERMINATED


def test_unknown_outcome_is_reconciled_manually_with_evidence(clock, monkeypatch):
    run = unknown_run(clock, monkeypatch)
    assert run.steps.get(step_name="notify").state == StepState.UNKNOWN
    operator = login("operator")
    page = operator.get(reverse("console:run", args=[run.workflow_id]))
    assert 'data-action="resolve_happened:notify"' in page.text and 'data-action="reconcile:notify"' in page.text
    missing = act(operator, run, "resolve_happened", step="notify", remote_ref="")
    assert missing.status_code == 400 and "remote id" in missing.text
    message_id = f"msg-{RemoteObject.objects.get(kind='message').pk}"  # what the messenger's own UI shows
    assert act(operator, run, "resolve_happened", step="notify", remote_ref=message_id).status_code == 200
    notify = run.steps.get(step_name="notify")
    assert (notify.state, notify.remote_ref) == (StepState.SUCCEEDED, message_id)
    event = AuditEvent.objects.get(run=run, action="resolve")
    assert event.after["evidence"] == {
        "happened": True,
        "remote_ref": message_id,
        "checked": f"looked up at the receiver: {message_id} is this step's",
    }
    assert notify.result == {"message_id": RemoteObject.objects.get(kind="message").pk}  # what the receiver said
    monkeypatch.undo()
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts()["message"] == 1  # never sent twice


def test_without_javascript_an_action_redirects_back_to_the_run(clock):
    run = failed_run(clock)
    response = act(login("operator"), run, "retry", step="create_task", htmx=False)
    assert response.status_code == 302 and response["Location"] == reverse("console:run", args=[run.workflow_id])


def test_bulk_resume_shows_a_dry_run_then_applies_to_each_run_and_lists_the_ones_it_could_not_touch(clock):
    runs = [failed_run(clock, f"bulk-{i}") for i in range(3)]
    done = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "done"})[0], clock)
    operator = login("operator")
    ids = [r.workflow_id for r in runs] + [done.workflow_id]
    events = AuditEvent.objects.count()
    preview = operator.post(reverse("console:bulk"), {"action": "resume", "reason": "tracker back", "run": ids})
    assert preview.status_code == 200
    assert "Dry run: nothing has changed yet. <b>3</b> of 4 selected runs would be changed" in preview.text
    assert "a finished run cannot be resumed" in preview.text
    assert AuditEvent.objects.count() == events  # a dry run writes nothing

    response = confirm(operator, preview)
    assert "3 runs changed" in response.text
    assert AuditEvent.objects.filter(action="resume", reason="tracker back").count() == 3
    assert set(WorkflowRun.objects.filter(pk__in=[r.pk for r in runs]).values_list("state", flat=True)) == {"pending"}
    assert WorkflowRun.objects.get(pk=done.pk).state == RunState.COMPLETED
    forged = login("viewer").post(reverse("console:bulk"), {"action": "resume", "reason": "x", "run": ids})
    assert forged.status_code == 403
    terminate = {"action": "terminate", "reason": "x", "run": ids, "confirm": "yes"}
    assert operator.post(reverse("console:bulk"), terminate).status_code == 403  # terminate is a supervisor's
    assert AuditEvent.objects.filter(action="terminate").count() == 0


def test_bulk_on_all_runs_matching_the_filter_confirms_exactly_the_runs_it_showed(clock):
    for i in range(3):
        failed_run(clock, f"f-{i}")
    supervisor = login("supervisor")
    preview = supervisor.post(
        reverse("console:bulk"), {"action": "terminate", "reason": "bad batch", "all_matching": "1", "state": "failed"}
    )
    assert "<b>3</b> of 3 selected runs would be changed" in preview.text
    failed_run(clock, "f-late")  # fails after the dry run: not in what was confirmed
    response = confirm(supervisor, preview)
    assert "3 runs changed" in response.text
    assert WorkflowRun.objects.filter(state=RunState.TERMINATED).count() == 3
    assert WorkflowRun.objects.get(workflow_id="order:t:f-late").state == RunState.FAILED


def test_filters_search_and_keyset_pages_with_a_constant_number_of_queries(clock, monkeypatch):
    for i in range(120):
        run_start(workflow="test_orders", data={"tenant": "t", "order_id": f"p-{i:03d}"})
    stuck = unknown_run(clock, monkeypatch)
    viewer = login("viewer")
    first = viewer.get(reverse("console:runs"))
    assert first.text.count('name="run"') == 0  # viewers get no bulk checkboxes
    runs_on = lambda r: r.text.count('<td><a href="/runs/')  # noqa: E731
    assert runs_on(first) == 50
    cursor = first.context["next_cursor"]
    with CaptureQueriesContext(connection) as page1:
        viewer.get(reverse("console:runs"))
    with CaptureQueriesContext(connection) as page3:
        third = viewer.get(reverse("console:runs") + f"?after={cursor - 50}")
    assert len(page1) == len(page3)
    assert runs_on(third) == 21 and third.context["next_cursor"] is None
    assert not any("COUNT(*)" in q["sql"] and "LIMIT" not in q["sql"] for q in page1.captured_queries)

    assert stuck.workflow_id in viewer.get(reverse("console:runs") + "?stuck=unknown").text
    assert "p-001" not in viewer.get(reverse("console:runs") + "?stuck=unknown").text
    key = stuck.steps.get(step_name="create_task").idempotency_key
    found = viewer.get(reverse("console:runs") + f"?q={key}")
    assert runs_on(found) == 1 and stuck.workflow_id in found.text
    assert runs_on(viewer.get(reverse("console:runs") + "?key=order:t:p-00")) == 10


def test_htmx_refresh_returns_only_the_part_asked_for_and_keeps_the_filters(clock):
    failed_run(clock)
    viewer = login("viewer")
    url = reverse("console:runs") + "?state=failed"
    table = viewer.get(url, headers={"HX-Request": "true", "HX-Target": "runs-table"})
    assert table.text.lstrip().startswith('<section id="runs-table"') and "<html" not in table.text
    assert 'hx-trigger="every 15s"' in table.text  # a viewer has no selection to lose: the list refreshes itself
    counts = viewer.get(url, headers={"HX-Request": "true", "HX-Target": "counts"})
    assert 'hx-get="/?state=failed"' in counts.text
    assert table["Vary"].count("HX-Request") == 1


def test_dashboard_and_demo_pages(clock):
    failed_run(clock)
    assert "<svg" in login("viewer").get(reverse("console:dashboard")).text
    assert login("operator").get(reverse("demo")).status_code == 403


def test_bulk_with_a_run_id_holding_a_line_break_is_400_with_a_message_and_changes_nothing(clock):
    """Found by the fuzzer: such an id matched no run page, so listing it back crashed (500)."""
    run = failed_run(clock)
    before = AuditEvent.objects.count()
    supervisor = login("supervisor")
    data = {"action": "resume", "reason": "fuzz", "run": ["\n", run.workflow_id]}
    response = supervisor.post(reverse("console:bulk"), data, headers={"HX-Request": "true"})
    assert response.status_code == 400 and "line break" in response.text
    assert AuditEvent.objects.count() == before and WorkflowRun.objects.get(pk=run.pk).state == run.state


def test_the_runs_table_keeps_the_selection_across_its_refreshes(clock):
    runs = [failed_run(clock, f"sel-{i}") for i in range(3)]
    operator = login("operator")
    refresh = {"HX-Request": "true", "HX-Target": "runs-table"}
    table = operator.get(reverse("console:runs"), {"run": runs[1].workflow_id}, headers=refresh).text
    checked = re.findall(r'name="run" value="([^"]+)"[^>]*checked', table)
    assert checked == [runs[1].workflow_id]
    everything = operator.get(reverse("console:runs"), {"select": "page"}, headers=refresh).text
    assert sorted(re.findall(r'name="run" value="([^"]+)"[^>]*checked', everything)) == sorted(
        r.workflow_id for r in runs
    )
    assert 'hx-include="#runs-table input[name=run]:checked"' in table and 'hx-trigger="every 15s"' in table
    options = re.findall(
        r'<option value="(\w+)">', operator.get(reverse("console:runs")).text.split('id="bulk-actions"')[1]
    )
    assert options == ["resume", "pause", "unpause", "retry"]  # terminate is a supervisor's


def test_every_button_is_worded_by_the_action_table_with_facts_the_console_fills_in():
    """recovery.actions holds each action's button and question; the console only fills them in
    (recovery.console.services._button). Decisions are edited in a form of their own, a restart
    has its page (recovery.console.restart_views), and a held tool call is decided in its section
    (recovery.console.call_forms)."""
    import string

    from recovery.actions import ACTIONS

    facts = {"step", "agent", "turn", "rule", "description"}
    for name, spec in ACTIONS.items():
        texts = [spec.button, spec.ask, spec.button_run, spec.ask_run]
        own_form = ("supersede", "decide_again", "restart", "approve_call", "edit_call", "reject_call", "answer_call")
        assert bool(spec.button) == (name not in own_form), name
        assert bool(spec.button_run) == (spec.step == "optional"), name
        named = {field for text in texts for _, field, _, _ in string.Formatter().parse(text) if field}
        assert named <= facts, (name, named - facts)
