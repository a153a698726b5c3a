"""The run page tells the truth at a glance (issue 16, items 5, 6 and 9): current state first and
history second, JSON as JSON, full keys; it stays live while the run can move and stops polling
when it cannot; and a refusal or a missing button always says why, inside the console."""

import json
import re
from datetime import timedelta

import pytest
from django.urls import reverse

from recovery.console import selectors
from recovery.engine.executor import advance
from recovery.engine.transitions import perform, run_claim, run_compensate, run_release, run_start, run_version
from recovery.models import WorkflowRun
from sandbox import faults
from sandbox.models import Fault
from tests.support import receivers
from tests.support.console import act, login
from tests.support.engine import drive, person

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])


def start(order_id: str) -> WorkflowRun:
    return run_start(workflow="test_orders", data={"tenant": "t", "order_id": order_id, "text": "office chairs 120"})[0]


def page(client, run) -> str:
    return client.get(reverse("console:run", args=[run.workflow_id])).content.decode()


def test_a_step_waiting_to_retry_is_not_shown_failed_and_a_succeeded_step_shows_no_current_error(clock):
    receivers.arm("task", "unavailable")
    run = start("retry")
    advance(run.pk)
    viewer = login("viewer")
    html = page(viewer, run)
    row = html.split('data-step="create_task"')[1].split("</tr>")[0]
    assert "Retrying" in row and "step-failed" not in row

    run = drive(run, clock)
    row = page(viewer, run).split('data-step="create_task"')[1].split("</tr>")[0]
    assert "Succeeded" in row and "503 service unavailable" not in row
    assert "earlier: transient" in row  # the history keeps it


def test_the_history_reads_states_by_their_labels_and_the_export_keeps_the_values(clock):
    receivers.arm("task", "forbidden")
    run = drive(start("labels"), clock)
    viewer = login("viewer")
    history = page(viewer, run).split('id="run-history"')[1].split("</table>")[0]
    assert "run: Running → Failed" in history and "step: Running → Failed" in history
    assert "running →" not in history and "→ failed" not in history  # no internal value in people's text
    export = viewer.get(reverse("console:audit-export"), {"format": "jsonl", "run": run.workflow_id})
    assert '"run":"failed"' in b"".join(export.streaming_content).decode()  # an API: the values, unchanged


def test_input_intents_results_and_decisions_are_pretty_json_and_keys_are_whole(clock):
    run = drive(start("json"), clock)
    html = page(login("viewer"), run)
    assert "{&#x27;" not in html and "&#x27;approver&#x27;:" not in html  # no Python repr
    assert "&quot;text&quot;: &quot;office chairs 120&quot;" in html  # the input
    intent = run.steps.get(step_name="create_task").intent
    assert json.dumps(intent, indent=2, sort_keys=True).replace('"', "&quot;") in html
    for step in run.steps.all():
        assert f"<code>{step.idempotency_key}</code>" in html  # the whole key
        assert f'data-copy="{step.idempotency_key}"' in html


def test_a_partly_compensated_completed_run_is_not_a_plain_green_completed(clock):
    run = drive(start("partly"), clock)
    run_compensate(workflow_id=run.workflow_id, step_name="post_entry", actor=None, reason="undo the entry")
    run = drive(run, clock)
    html = page(login("viewer"), run)
    assert "Completed, partly compensated" in html and 'class="state state-completed"' not in html


def test_the_page_polls_its_live_parts_while_the_run_can_move_and_stops_when_it_is_finished(clock):
    receivers.arm("task", "unavailable")
    run = start("live")
    advance(run.pk)
    run.refresh_from_db()
    viewer = login("viewer")
    assert 'id="run-poll"' in page(viewer, run) and 'hx-trigger="every 3s"' in page(viewer, run)
    shown = run_version(run)
    live = reverse("console:run", args=[run.workflow_id])
    headers = {"HX-Request": "true", "HX-Target": "run-poll"}

    same = viewer.get(live, {"live": "1", "shown": shown}, headers=headers)
    assert same.status_code == 200
    body = same.content.decode()
    for part in ("run-head", "run-steps", "run-history", "run-poll"):
        assert f'id="{part}"' in body and body.count('hx-swap-oob="true"') >= 4
    assert 'name="reason"' not in body  # the operator's half-typed reasons are left alone
    assert "has changed since the page was loaded" not in body

    run = drive(run, clock)
    done = viewer.get(live, {"live": "1", "shown": shown}, headers=headers)
    assert done.status_code == 286  # htmx stops polling
    body = done.content.decode()
    assert "Completed" in body and "has changed since the page was loaded" in body
    assert 'hx-trigger="every 3s"' not in body
    assert 'id="run-poll"' not in page(viewer, run)


def test_a_poll_that_would_show_nothing_new_swaps_nothing_and_the_clock_alone_can_change_it(clock):
    """What an operator opened on the page (the event list, an intent) and where their keyboard
    is stay as they are while nothing shown changes (issue 16, items 6 and 8)."""
    run = start("quiet")
    lease = run_claim(run_pk=run.pk, owner="w2@host")
    run.refresh_from_db()
    viewer = login("viewer")
    live = reverse("console:run", args=[run.workflow_id])
    headers = {"HX-Request": "true", "HX-Target": "run-poll"}
    seen = re.search(r"seen=(\w+)", page(viewer, run)).group(1)

    unchanged = viewer.get(live, {"live": "1", "shown": run_version(run), "seen": seen}, headers=headers)
    assert unchanged.status_code == 204 and unchanged.content == b""

    clock.set(run.lease_expires_at + timedelta(seconds=1))  # only the clock moved, and the sentence with it
    moved_on = viewer.get(live, {"live": "1", "shown": run_version(run), "seen": seen}, headers=headers)
    body = moved_on.content.decode()
    assert moved_on.status_code == 200 and "the lease of w2@host expired" in body
    newer = re.search(r"seen=(\w+)", body).group(1)
    assert newer != seen
    assert viewer.get(live, {"live": "1", "seen": newer}, headers=headers).status_code == 204

    run_release(lease=lease, reason="handed back")  # the run itself changes
    changed = viewer.get(live, {"live": "1", "seen": newer}, headers=headers)
    assert changed.status_code == 200 and "due now" in changed.content.decode()


def test_the_runs_lists_refresh_asks_with_the_filters_and_the_page_never_an_old_selection(clock):
    operator = login("operator")
    html = operator.get(reverse("console:runs"), {"state": "failed", "run": "order:t:x", "select": "page"}).text
    refreshes = re.findall(r'hx-get="([^"]*)" hx-trigger="(?:load, )?every', html)
    assert refreshes == ["/?state=failed", "/?state=failed"]  # the counts and the table


def test_a_refusal_outside_htmx_is_a_page_of_the_console_with_a_way_back(clock):
    receivers.arm("task", "forbidden")
    run = drive(start("refused"), clock)
    viewer = login("viewer")
    response = act(viewer, run, "retry", step="create_task", htmx=False)
    assert response.status_code == 403
    html = response.content.decode()
    assert "Recovery Console" in html and "<nav>" in html  # the console's layout, not a bare fragment
    assert "Your role (viewer) may not act here: that needs the operator role." in html
    assert "Go back" in html and "Nothing was changed" in html
    response = viewer.get(reverse("demo"))
    assert response.status_code == 403 and "may not sandbox here: that needs the supervisor role" in response.text


def test_the_demo_link_shows_only_to_whom_may_use_it_and_clearing_needs_a_confirmation(clock):
    assert 'href="/demo"' not in login("operator").get(reverse("console:runs")).text
    supervisor = login("supervisor")
    assert 'href="/demo"' in supervisor.get(reverse("console:runs")).text
    faults.set_fault("tasks", "create", "forbidden")
    armed = Fault.objects.using("sandbox").filter(remaining__gt=0)
    refused = supervisor.post(reverse("demo"), {"what": "clear"})
    assert refused.status_code == 400 and "tick the box to clear" in refused.text
    assert armed.count() == 1  # nothing cleared
    cleared = supervisor.post(reverse("demo"), {"what": "clear", "confirm": "yes"})
    assert cleared.status_code == 200 and "sandbox cleared" in cleared.text
    assert armed.count() == 0


def test_a_page_without_buttons_says_which_role_could_act(clock):
    receivers.arm("ledger", "forbidden")
    run = drive(start("late"), clock)  # failed: the task's compensation and terminate are a supervisor's
    html = page(login("operator"), run)
    assert "A higher role could also:" in html and "compensate" in html.split("A higher role could also:")[1]
    assert "terminate" in html.split("A higher role could also:")[1].split("</p>")[0]


def test_the_timeline_compresses_a_long_quiet_gap_marks_operators_and_lists_every_event(clock):
    receivers.arm("task", "forbidden")
    run = drive(start("timeline"), clock)
    clock.advance(2 * 3600 + 13 * 60)  # two hours later an operator retries
    olga = person("olga", "operator")
    perform("retry", workflow_id=run.workflow_id, step_name="create_task", actor=olga, reason="permission granted")
    run = drive(run, clock)
    line = selectors.timeline(run, list(run.steps.order_by("position")))

    assert [g["label"] for g in line["gaps"]] == ["+2 h 13 min"]
    xs = [b["x"] for b in line["bars"]]  # each attempt a bar (from its begin to its outcome)
    assert xs == sorted(xs) and xs[-1] - xs[0] <= line["width"] - line["left"]
    # The two hours are drawn as a narrow gap, not as the whole width (the test's clock stands
    # still within each burst, so each burst is one instant).
    assert xs[-1] - xs[0] == pytest.approx(selectors._TimeScale.GAP)
    assert [o["actor"] for o in line["operators"]] == ["olga"]
    assert line["ticks"][0]["label"] == f"{run.created_at:%H:%M:%S} UTC" and len(line["ticks"]) >= 1
    listed = [e["what"] for e in line["events"]]
    assert "retry create_task" in listed and "create_task: step_fail" in listed
    html = page(login("viewer"), run)
    assert "+2 h 13 min" in html and "retry create_task — by olga" in html
    # every bar, mark and the operator line focusable
    assert html.count('tabindex="0"') >= len(line["bars"]) + len(line["marks"]) + 1


@pytest.mark.parametrize("workflow_id", ["order:t:o-1", "order:t:a b/c?d#e%f", "order:ümlaut:ä&x=1", "order:t:+;,'()*"])
def test_the_runs_list_links_each_run_exactly_as_reverse_would(workflow_id):
    from django.urls import reverse as django_reverse

    from recovery.console.views import run_href

    prefix = django_reverse("console:run", args=["-"])[:-1]
    assert run_href(workflow_id, prefix) == django_reverse("console:run", args=[workflow_id])
