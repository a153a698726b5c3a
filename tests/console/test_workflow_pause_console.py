"""A workflow's pause in the console (issue 37): a supervisor pauses a workflow or one step from the
dashboard; the runs list and the dashboard show it at the top with the runs it holds; the held
runs' own unpause is not offered; releasing it lets them go on. Refusals change nothing."""

from __future__ import annotations

import html
from datetime import timedelta

import pytest
from django.urls import reverse

from recovery.engine.executor import advance
from recovery.engine.transitions import run_start, workflow_pause
from recovery.models import RunState, WorkflowPause, WorkflowRun
from tests.support import receivers
from tests.support.console import login
from tests.support.engine import drive, person

pytestmark = pytest.mark.django_db

PAUSES = reverse("console:workflow-pauses")


def started(order_id: str) -> WorkflowRun:
    return run_start(workflow="test_orders", data={"tenant": "t", "order_id": order_id})[0]


def text(response) -> str:
    return html.unescape(response.content.decode())


def pauses() -> list[tuple]:
    return list(WorkflowPause.objects.order_by("pk").values_list("workflow_name", "step_name", "released_at"))


def test_a_supervisor_pauses_a_step_from_the_dashboard_and_releases_the_runs_it_held(clock):
    sam = login("supervisor")
    page = text(sam.get(reverse("console:dashboard")))
    assert '<option value="test_orders:post_entry">test_orders · step post_entry</option>' in page
    assert 'value="test_local:reserve"' not in page  # a local step makes no attempt to stop before
    assert "None: every workflow runs." in page

    posted = sam.post(PAUSES, {"action": "pause", "target": "test_orders:post_entry", "reason": "ledger outage"})
    assert posted.status_code == 302 and posted["Location"] == reverse("console:dashboard") + "#workflow-pauses"
    run = drive(started("c-1"), clock)
    assert run.state == RunState.PAUSED and receivers.counts()["ledger"] == 0

    page = text(sam.get(reverse("console:dashboard")))
    banner = page.split('id="paused-banner"')[1].split("</section>")[0]
    assert "step post_entry of test_orders</strong>, by u-supervisor at " in banner
    assert ": ledger outage — 1 run held." in banner
    assert 'data-pause="test_orders:post_entry"' in page and "Unpause step post_entry of test_orders" in page
    listed = text(sam.get(reverse("console:runs")))
    assert 'id="paused-banner"' in listed and "step post_entry of test_orders" in listed
    run_page = text(sam.get(reverse("console:run", args=[run.workflow_id])))
    assert "step post_entry of test_orders paused: ledger outage" in run_page
    assert 'data-action="unpause"' not in run_page  # held by the workflow's pause: released with it

    posted = sam.post(PAUSES, {"action": "unpause", "target": "test_orders:post_entry", "reason": "ledger back"})
    assert posted.status_code == 302
    assert "None: every workflow runs." in text(sam.get(reverse("console:dashboard")))
    assert 'id="paused-banner"' not in text(sam.get(reverse("console:runs")))
    assert drive(run, clock).state == RunState.COMPLETED and receivers.counts()["ledger"] == 1


def test_a_whole_workflow_paused_shows_the_new_runs_it_keeps_pending(clock):
    sam = login("supervisor")
    sam.post(PAUSES, {"action": "pause", "target": "test_orders", "reason": "tracker outage"})
    for order_id in ("c-2", "c-3"):
        assert advance(started(order_id).pk, owner="test-executor") is None  # not claimed
    banner = text(sam.get(reverse("console:runs"))).split('id="paused-banner"')[1].split("</section>")[0]
    assert "workflow test_orders</strong>" in banner and "0 runs held, 2 new runs kept pending." in banner


@pytest.mark.parametrize(
    ("role", "form", "status", "message"),
    [
        ("operator", {"action": "pause", "target": "test_orders", "reason": "x"}, 403, "may not pause_workflow"),
        ("viewer", {"action": "unpause", "target": "test_orders:notify", "reason": "x"}, 403, "may not pause_workflow"),
        ("supervisor", {"action": "stop", "target": "test_orders", "reason": "x"}, 400, "unknown action 'stop'"),
        ("supervisor", {"action": "pause", "target": "nope", "reason": "x"}, 400, "no workflow 'nope' is deployed"),
        ("supervisor", {"action": "pause", "target": "test_orders:nope", "reason": "x"}, 400, "has no step 'nope'"),
        ("supervisor", {"action": "pause", "target": "test_orders", "reason": " "}, 400, "a reason is required"),
        ("supervisor", {"action": "pause", "target": "test_orders:notify", "reason": "x"}, 409, "paused already"),
        ("supervisor", {"action": "unpause", "target": "test_orders", "reason": "x"}, 409, "is not paused"),
    ],
)
def test_bad_pauses_in_the_console_are_refused_and_change_nothing(role, form, status, message):
    workflow_pause(workflow="test_orders", step_name="notify", actor=person("boss"), reason="chat outage")
    before = pauses()
    response = login(role).post(PAUSES, form, headers={"HX-Request": "true"})
    assert response.status_code == status and message in text(response)
    assert pauses() == before


def test_only_a_supervisor_sees_the_pause_forms():
    assert 'action="/workflows/pauses"' in text(login("supervisor").get(reverse("console:dashboard")))
    assert 'action="/workflows/pauses"' not in text(login("operator").get(reverse("console:dashboard")))


def test_a_supervisor_releases_a_canary_sees_its_outcome_then_releases_the_rest_in_waves(clock):
    sam = login("supervisor")
    sam.post(PAUSES, {"action": "pause", "target": "test_orders:post_entry", "reason": "ledger outage"})
    runs = [drive(started(f"k-{i}"), clock) for i in range(4)]
    form = {"action": "unpause", "target": "test_orders:post_entry", "reason": "ledger back?", "release": "canary"}
    assert sam.post(PAUSES, {**form, "canary": "2"}).status_code == 302
    for run in runs[:2]:
        assert drive(run, clock).state == RunState.COMPLETED
    page = text(sam.get(reverse("console:dashboard")))
    row = page.split('data-pause="test_orders:post_entry"')[1].split("</tr>")[0]
    assert "<td data-canary>2 completed</td>" in row and '<td class="num">2</td>' in row  # 2 still held

    bad = sam.post(PAUSES, {**form, "release": "all", "wave_size": "2"}, headers={"HX-Request": "true"})
    assert bad.status_code == 400 and "1 to 3600 seconds" in text(bad)
    assert WorkflowPause.objects.get().released_at is None
    done = sam.post(PAUSES, {**form, "release": "all", "wave_size": "1", "wave_seconds": "30"})
    assert done.status_code == 302 and WorkflowPause.objects.get().released_at is not None
    waits = [WorkflowRun.objects.get(pk=r.pk).next_wake_at for r in runs[2:]]
    assert all(w is not None and w > clock.now() for w in waits)  # in waves, not at once
    assert [drive(r, clock).state for r in runs[2:]] == [RunState.COMPLETED] * 2
    assert receivers.counts()["ledger"] == 4


def test_a_bulk_resume_in_waves_makes_each_run_due_in_its_wave_not_all_at_once(clock):
    from tests.support.console import confirm, failed_run

    runs = [failed_run(clock, f"bw-{i}") for i in range(3)]
    receivers.clear()
    operator = login("operator")
    ids = [r.workflow_id for r in runs]
    form = {"action": "resume", "reason": "tracker back", "run": ids, "wave_size": "1", "wave_seconds": "60"}
    preview = operator.post(reverse("console:bulk"), form)
    assert "reason “tracker back”, released in 3 waves of 1, 60 s apart)" in text(preview)
    now = clock.now()
    done = confirm(operator, preview)
    assert "3 runs changed, each with its own audit event, released in 3 waves of 1, 60 s apart." in text(done)
    for wave, run in enumerate(runs):
        run.refresh_from_db()
        assert run.state == RunState.PENDING
        assert now + timedelta(seconds=60 * wave) <= run.next_wake_at < now + timedelta(seconds=60 * (wave + 1))
        assert run.audit_events.get(action="resume").after["due_at"] == run.next_wake_at.isoformat()
        assert advance(run.pk, owner="test-executor") is None  # not before its wave
    assert [drive(r, clock).state for r in runs] == [RunState.COMPLETED] * 3

    bad = login("supervisor").post(reverse("console:bulk"), {**form, "action": "terminate"})
    assert bad.status_code == 400 and "terminate makes no run due: waves are for resume, retry and unpause" in text(bad)
    half = operator.post(reverse("console:bulk"), {**form, "wave_seconds": ""})
    assert half.status_code == 400 and "1 to 3600 seconds between waves" in text(half)
