"""Issue 16, items 1–9, in a real browser (Debian's Chromium driven by Playwright): what an
operator sees and does at 3 a.m., one test (or more) per item, each asserting what must happen
and what must not (the run's state and the simulated systems' objects, read from the database).
Each saves a screenshot named after its item under var/screenshots/ (kept by CI as artefacts).

Time: the engine runs on the ``clock`` fixture (a movable clock; the live server reads it too);
the browser's own timers (the htmx polls) are moved with Playwright's clock where a test needs a
refresh to happen, and every wait is an auto-waiting ``expect`` on what the page shows."""

from __future__ import annotations

import itertools
import json
import re
from urllib.parse import parse_qs, urlparse

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from playwright.sync_api import expect

from recovery.engine.executor import advance
from recovery.engine.transitions import run_compensate, run_start, run_terminate
from recovery.models import AuditEvent, DecisionState, ModelDecision, RunState, StepState, WorkflowRun
from sandbox import faults
from sandbox.models import Fault
from tests.browser.conftest import needs_chromium, shot
from tests.support import receivers
from tests.support.engine import crash_at, drive

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=["default", "sandbox"]),
    needs_chromium,
]

LIVE = 30_000  # ms: what the page shows after its 3 s poll, on a busy machine
RED = "rgb(192, 57, 43)"  # console.css --red: a failed step's badge
_ids = itertools.count()


# --- runs in the states the items are about (as tests/engine/test_action_offers.py builds them) ---


def start(order_id: str | None = None, *, tenant: str = "t", workflow: str = "test_orders") -> WorkflowRun:
    order_id = order_id or f"o-{next(_ids)}"
    return run_start(workflow=workflow, data={"tenant": tenant, "order_id": order_id})[0]


def failed_early(clock, order_id=None, **kw) -> WorkflowRun:
    """The tracker refused the task (403): failed, nothing written elsewhere."""
    receivers.arm("task", "forbidden")
    return drive(start(order_id, **kw), clock)


def failed_late(clock, order_id=None, **kw) -> WorkflowRun:
    """The task and the message exist; the ledger refused (403): failed, its effects stand."""
    receivers.arm("ledger", "forbidden")
    return drive(start(order_id, **kw), clock)


def compensation_failed(clock, order_id=None) -> WorkflowRun:
    """Failed late, compensated as a whole: the correction went out, the tracker refused to cancel
    the task (403): compensation_failed, create_task's compensation failed, notify compensated."""
    run = failed_late(clock, order_id)
    receivers.arm("task_cancel", "forbidden")
    run_compensate(workflow_id=run.workflow_id, step_name=None, actor=None, reason="vendor blocked")
    return drive(run, clock)


def waiting_to_retry(order_id=None, *, fault="rate_limit") -> WorkflowRun:
    """create_task answered 429 (or 503) once: the run waits for its next attempt."""
    receivers.arm("task", fault)
    run = start(order_id)
    advance(run.pk)
    run.refresh_from_db()
    return run


def states(*runs: WorkflowRun) -> dict[str, str]:
    return dict(WorkflowRun.objects.filter(pk__in=[r.pk for r in runs]).values_list("workflow_id", "state"))


def pretty(value) -> str:
    """JSON as the console prints it (recovery/templatetags/console.py pretty_json)."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


def executor_errors(run: WorkflowRun) -> list[str]:
    return list(
        AuditEvent.objects.filter(run=run, action="review", reason__startswith="executor error").values_list(
            "reason", flat=True
        )
    )


# --- the page, as an operator uses it --------------------------------------------------------


def open_run(page, live_server, run: WorkflowRun) -> None:
    page.goto(f"{live_server.url}/runs/{run.workflow_id}")
    expect(page.locator("#run-head h1")).to_contain_text(run.workflow_id)


def offered(page) -> set[str]:
    """The run page's action buttons, by their data-action (``name`` or ``name:step``)."""
    return set(
        page.locator("section.actions button[data-action]").evaluate_all("(bs) => bs.map((b) => b.dataset.action)")
    )


def press(page, action: str, reason: str, *, dialog: str | None = None) -> None:
    """Fill the reason of the action's form and press its button; ``dialog``: the confirmation
    it must ask first (accepted)."""
    asked: list[str] = []

    def answer(d):
        asked.append(d.message)
        d.accept()

    page.on("dialog", answer)
    form = page.locator("form.action", has=page.locator(f'button[data-action="{action}"]'))
    if not form.is_visible():  # all but the recommended action are folded under "More actions"
        page.locator("section.actions details.more-actions > summary").click()
    form.locator("input[name=reason]").fill(reason)
    form.locator(f'button[data-action="{action}"]').click()
    expect(page.locator("#run-body .flash.ok")).to_be_visible()
    page.remove_listener("dialog", answer)
    if dialog is None:
        assert asked == [], f"{action} asked {asked} before it acted"
    else:
        assert len(asked) == 1 and asked[0].startswith(dialog), asked


def step_row(page, step: str):
    return page.locator(f'tr[data-step="{step}"]')


def intent_row(page, step: str):
    return page.locator(f'tr[data-step="{step}"] + tr.intent')


def replaced(page, element_id: str, refresh) -> None:
    """Call ``refresh`` (something that makes the page refresh a part of itself) and wait until
    the element ``element_id`` has been replaced by a new one and htmx has settled it."""
    page.evaluate("(id) => { document.getElementById(id).__shown = true; }", element_id)
    refresh()
    page.wait_for_function(
        """(id) => { const el = document.getElementById(id);
                    return el && !el.__shown && !el.matches('.htmx-added, .htmx-settling, .htmx-swapping'); }""",
        arg=element_id,
        timeout=LIVE,
    )


def polled(page, refresh) -> None:
    """Call ``refresh`` (moving the page's clock past its 3 s poll) and wait until the run page's
    poll has come back and htmx has done with its answer, whatever it swapped (or not)."""
    page.evaluate(
        # on the poll element itself: its own answer may replace it (out of band), and an event
        # on a detached element reaches no ancestor
        """() => { window.__polls = 0;
                   document.getElementById("run-poll").addEventListener("htmx:afterRequest", () => {
                     window.__polls++; }); }"""
    )
    refresh()
    busy = ".htmx-request, .htmx-swapping, .htmx-added, .htmx-settling"
    page.wait_for_function(f"() => window.__polls > 0 && !document.querySelector('{busy}')", timeout=LIVE)


def wait_until_the_page_stops_polling(page) -> None:
    page.wait_for_function("() => !document.querySelector('#run-poll[hx-trigger]')", timeout=LIVE)


def listed(page) -> list[str]:
    """The workflow ids on the runs list, in order."""
    return page.locator("table.runs tbody a[href^='/runs/']").all_inner_texts()


def row_of(page, run: WorkflowRun):
    return page.locator("table.runs tbody tr", has=page.get_by_role("link", name=run.workflow_id, exact=True))


def stuck_chip(page, label: str):
    """A stuck cause's chip on the runs list (its count is in its <b>)."""
    return page.locator(".chips.stuck a.chip", has_text=re.compile(rf"^{re.escape(label)}\s"))


def search(page, text: str, **fields: str) -> None:
    """Type into the runs list's search box (and set other filters) and press Enter."""
    form = page.locator("form.filters")
    for name, value in fields.items():
        form.locator(f"select[name={name}]").select_option(value)
    form.locator("input[name=q]").fill(text)
    with page.expect_navigation():
        form.locator("input[name=q]").press("Enter")
    assert parse_qs(urlparse(page.url).query) == {"q": [text], **{k: [v] for k, v in fields.items()}}


# --- item 1: only actions whose transition is valid ------------------------------------------


def test_item1_a_compensation_failed_run_offers_neither_retry_nor_resume_and_what_it_offers_works(
    page_as, clock, live_server
):
    runs = [compensation_failed(clock, f"cf-{i}") for i in range(3)]
    for run in runs:
        assert run.state == RunState.COMPENSATION_FAILED
        steps = dict(run.steps.values_list("step_name", "state"))
        assert steps["create_task"] == StepState.COMPENSATION_FAILED and steps["notify"] == StepState.COMPENSATED
    made = receivers.counts()
    undone = receivers.compensations()
    assert made == {"task": 3, "message": 3, "ledger": 0, "model_call": 3}
    assert undone == {"task_cancel": 0, "correction": 3, "reversal": 0}

    page = page_as("supervisor")
    expect(stuck_chip(page, "Compensation failed").locator("b")).to_have_text("3")
    stuck_chip(page, "Compensation failed").click()
    page.wait_for_url("**/?stuck=compensation_failed")
    assert sorted(listed(page)) == sorted(r.workflow_id for r in runs)

    # The whole run, its failed compensation alone, or terminate: nothing that sends it forward.
    page.get_by_role("link", name=runs[0].workflow_id, exact=True).click()
    expect(page.locator("#run-head .state")).to_have_text("Compensation Failed")
    expect(page.locator("[data-why]")).to_have_text(
        "Now: the compensation of create_task failed: create_task: compensation failed: task_cancel: 403 forbidden; "
        "compensate again once the cause is fixed, or terminate"
    )
    assert offered(page) == {"compensate", "compensate:create_task", "terminate"}
    assert page.get_by_role("button", name=re.compile(r"^(Retry|Resume)")).count() == 0
    assert not any(a.startswith(("retry", "resume", "reconcile", "resolve")) for a in offered(page))
    shot(page, "item1-compensation-failed-offers")

    # Each offered action, on its own run: accepted, and the executor brings the run to rest.
    receivers.clear()  # the tracker cancels tasks again
    press(page, "compensate", "tracker unblocked", dialog="Undo every completed effect of this run?")
    expect(page.locator("#run-body .flash.ok")).to_have_text("compensate recorded; the run is now compensating")
    drive(runs[0], clock)
    expect(page.locator("#run-head .state-compensated")).to_be_visible(timeout=LIVE)  # the page follows
    shot(page, "item1-compensation-failed-compensated")

    open_run(page, live_server, runs[1])
    press(page, "compensate:create_task", "tracker unblocked", dialog="Undo create_task: Cancel the task")
    drive(runs[1], clock)
    expect(page.locator("#run-head .state-compensated")).to_be_visible(timeout=LIVE)

    open_run(page, live_server, runs[2])
    press(page, "terminate", "keep the task", dialog="Stop this run for good?")
    expect(page.locator("#run-head .state-terminated")).to_be_visible()
    drive(runs[2], clock)

    assert states(*runs) == {
        runs[0].workflow_id: RunState.COMPENSATED,
        runs[1].workflow_id: RunState.COMPENSATED,
        runs[2].workflow_id: RunState.TERMINATED,
    }
    for run in runs:
        assert executor_errors(run) == []
        assert not run.steps.filter(state=StepState.RUNNING).exists()
    # Two tasks cancelled, nothing made again, the message not corrected twice.
    assert receivers.counts() == made
    assert receivers.compensations() == {"task_cancel": 2, "correction": 3, "reversal": 0}
    page.goto(f"{live_server.url}/?stuck=compensation_failed")
    expect(stuck_chip(page, "Compensation failed").locator("b")).to_have_text("0")
    assert listed(page) == []
    expect(stuck_chip(page, "Needs review").locator("b")).to_have_text("0")  # none dropped into a generic review


# --- item 2: a failed run whose effects wait for a decision is stuck ---------------------------


def test_item2_a_failed_run_with_standing_effects_is_under_stuck_and_the_count_matches(page_as, clock, live_server):
    late = failed_late(clock, "late")
    early = failed_early(clock, "early")  # failed, nothing written elsewhere: nothing to decide
    waiting = waiting_to_retry("waiting")  # the engine will retry as planned: not stuck
    done = drive(start("done"), clock)
    assert late.effects_stand and not WorkflowRun.objects.get(pk=early.pk).effects_stand

    page = page_as("operator")
    expect(stuck_chip(page, "Failed, effects stand").locator("b")).to_have_text("1")
    stuck_chip(page, "Failed, effects stand").click()
    page.wait_for_url("**/?stuck=failed_with_effects")
    assert listed(page) == [late.workflow_id]
    expect(stuck_chip(page, "Failed, effects stand").locator("b")).to_have_text(str(len(listed(page))))
    expect(row_of(page, late).locator("td.why")).to_have_text(
        "failed at post_entry (ledger: 403 forbidden); effects made by create_task, notify stand: "
        "compensate them, or terminate to keep them"
    )
    shot(page, "item2-stuck-failed-with-effects")

    page.get_by_role("navigation").get_by_role("link", name="Stuck").click()
    page.wait_for_url("**/?stuck=any")
    shown = listed(page)
    assert late.workflow_id in shown
    assert not {early.workflow_id, waiting.workflow_id, done.workflow_id} & set(shown)
    assert states(late, early, waiting, done) == {
        late.workflow_id: RunState.FAILED,
        early.workflow_id: RunState.FAILED,
        waiting.workflow_id: RunState.WAITING,
        done.workflow_id: RunState.COMPLETED,
    }


# --- item 3: "why is this run not moving?" --------------------------------------------------------


def test_item3_the_why_sentence_is_on_the_list_row_and_on_the_run_page(page_as, clock, live_server, monkeypatch):
    retrying = waiting_to_retry("why-retry")
    retry_says = (
        f"retrying create_task at {retrying.next_wake_at:%H:%M:%S} UTC "
        "(attempt 2 of 4; rate_limited: task: 429 too many requests)"
    )
    held = start("why-held")
    crash_at(monkeypatch, "create_task:after_call", lambda: advance(held.pk, owner="w2@host"))
    held.refresh_from_db()
    assert held.state == RunState.RUNNING and held.lease_expires_at > clock.now()
    held_says = f"held by executor w2@host until {held.lease_expires_at:%H:%M:%S} UTC (lease), running create_task"

    page = page_as("viewer")
    expect(row_of(page, retrying).locator("td.why")).to_have_text(retry_says)
    expect(row_of(page, held).locator("td.why")).to_have_text(held_says)
    shot(page, "item3-why-on-the-list")

    row_of(page, retrying).get_by_role("link", name=retrying.workflow_id).click()
    expect(page.locator("[data-why]")).to_have_text(f"Now: {retry_says}")
    expect(step_row(page, "create_task")).to_contain_text("Retrying")
    shot(page, "item3-why-on-the-run-page")
    open_run(page, live_server, held)
    expect(page.locator("[data-why]")).to_have_text(f"Now: {held_says}")

    # Once the lease has expired, the sentence says so (and the page follows without a reload).
    clock.advance(settings.RECOVERY_LEASE_SECONDS + 1)
    expect(page.locator("[data-why]")).to_have_text(
        f"Now: the lease of w2@host expired at {held.lease_expires_at:%H:%M:%S} UTC: "
        "waiting for another executor to take the run over",
        timeout=LIVE,
    )
    assert states(retrying, held) == {retrying.workflow_id: RunState.WAITING, held.workflow_id: RunState.RUNNING}


# --- item 4: search finds what an operator types -------------------------------------------------


def test_item4_search_finds_a_run_by_any_part_of_what_an_operator_knows(page_as, clock, live_server):
    acme = drive(start("INV-1002", tenant="acme"), clock)
    globex = drive(start("GX-2024-119", tenant="globex"), clock)
    initech = failed_early(clock, "IN-77", tenant="initech")
    # a's ledger entry reversed: its compensation's reference is searchable too
    run_compensate(workflow_id=acme.workflow_id, step_name="post_entry", actor=None, reason="wrong amount")
    acme = drive(acme, clock)

    def runs_matching(text: str) -> set[str]:
        """What the search must find, computed here: a part of the id or of a reference, any case,
        or the beginning of a key."""
        found = set()
        for run in WorkflowRun.objects.all():
            for step in run.steps.all():
                refs = [step.remote_ref.lower(), step.compensation_ref.lower()]
                if any(text.lower() in r for r in refs if r) or step.idempotency_key.startswith(text.lower()):
                    found.add(run.workflow_id)
            if text.lower() in run.workflow_id.lower():
                found.add(run.workflow_id)
        return found

    page = page_as("viewer")
    entry = globex.steps.get(step_name="post_entry").remote_ref
    reversal = acme.steps.get(step_name="post_entry").compensation_ref
    key = globex.steps.get(step_name="create_task").idempotency_key[:10]
    assert entry and reversal and globex.workflow_id in runs_matching(entry)
    assert initech.workflow_id not in runs_matching(entry) | runs_matching(reversal)
    for text, expected in [
        ("inv-100", {acme.workflow_id}),  # part of an invoice number, in lower case
        ("ACME", {acme.workflow_id}),  # the tenant: a business key fragment
        ("2024-1", {globex.workflow_id}),
        (entry.upper(), runs_matching(entry)),  # a remote reference
        (reversal, runs_matching(reversal)),  # a compensation's reference
        (key, {globex.workflow_id}),  # the beginning of an idempotency key
    ]:
        search(page, text)
        assert set(listed(page)) == expected, text
    search(page, "inv-100")
    shot(page, "item4-search-found")

    # Nothing found: the page says what was searched, and how to widen it.
    search(page, "zz-no-such-invoice")
    assert listed(page) == []
    expect(page.locator("[data-empty]")).to_have_text(
        "No run has “zz-no-such-invoice” in its workflow id, business key or a remote reference "
        "(compensations' too), and no step's idempotency key begins with it."
    )
    search(page, "inv-100", state="failed")
    assert listed(page) == []
    expect(page.locator("[data-empty]")).to_contain_text(
        "No run has “inv-100” in its workflow id, business key or a remote reference (compensations' too), "
        "and no step's idempotency key begins with it, among the runs that are failed."
    )
    shot(page, "item4-search-nothing-found")
    page.locator("[data-empty]").get_by_role("link", name="Search every run").click()
    page.wait_for_url(lambda url: parse_qs(urlparse(url).query) == {"q": ["inv-100"]})
    assert listed(page) == [acme.workflow_id]


# --- item 5: the step display tells the truth ----------------------------------------------------


def test_item5_steps_show_their_current_state_pretty_json_the_input_and_whole_keys_with_a_copy_button(
    page_as, clock, live_server
):
    run = waiting_to_retry("display", fault="unavailable")
    page = page_as("supervisor", permissions=["clipboard-read", "clipboard-write"])
    open_run(page, live_server, run)

    # Waiting to retry: "Retrying", not a red "Failed" (its current error is shown: it is current).
    badge = step_row(page, "create_task").locator(".state")
    expect(badge).to_have_text(re.compile(r"^Retrying at \d\d:\d\d:\d\d UTC$"))  # when, with its zone
    expect(badge).to_have_class(re.compile(r"\bstep-retrying\b"))
    assert step_row(page, "create_task").locator(".step-failed").count() == 0
    assert badge.evaluate("(el) => getComputedStyle(el).color") != RED
    expect(step_row(page, "create_task")).to_contain_text("503 service unavailable")
    shot(page, "item5-waiting-to-retry")

    # The executor retries and succeeds; the page follows, and the old error is history.
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    expect(badge).to_have_text("Succeeded", timeout=LIVE)
    wait_until_the_page_stops_polling(page)
    row = step_row(page, "create_task")
    expect(row).not_to_contain_text("503")
    expect(row).to_contain_text("earlier: transient (in the history)")
    expect(row.locator("td").nth(2)).to_have_text("2")  # attempts

    # The run's input, each intent and result, and the decision: JSON, pretty-printed.
    page.get_by_text("Input (the business event)").click()
    expect(page.locator("details.input pre")).to_be_visible()
    assert page.locator("details.input pre").inner_text() == pretty(run.input)
    task = run.steps.get(step_name="create_task")
    intent_row(page, "create_task").get_by_text("intent (checkpointed before the call)").click()
    intent_row(page, "create_task").locator("summary", has_text="result").click()
    pres = intent_row(page, "create_task").locator("pre")
    expect(pres.nth(0)).to_be_visible()
    assert pres.all_inner_texts() == [pretty(task.intent), pretty(task.result)]
    accepted = ModelDecision.objects.get(run=run, state=DecisionState.ACCEPTED)
    decision = page.locator("section", has=page.get_by_role("heading", name="Model decision")).locator("pre")
    assert decision.first.inner_text() == pretty(accepted.accepted)
    body = page.locator("main").inner_text()
    assert not re.search(r"[{,] ?'\w+': ", body)  # no Python repr anywhere

    # Whole keys, each with a copy button that puts the key on the clipboard.
    for step in run.steps.order_by("position"):
        code = intent_row(page, step.step_name).locator(".key code")
        expect(code).to_be_visible()
        assert code.inner_text() == step.idempotency_key and len(step.idempotency_key) > 15
    copy = page.get_by_role("button", name="copy the idempotency key of create_task")
    copy.click()
    expect(copy).to_have_text("copied")
    assert page.evaluate("navigator.clipboard.readText()") == task.idempotency_key
    shot(page, "item5-step-display")
    expect(copy).to_have_text("copy")  # and the button says "copy" again

    # Partly compensated: not a plain green "Completed". The actions are as loaded; the page's
    # note links the actions valid now.
    page.locator("#actions-note").get_by_role("link", name="reload").click()
    expect(page.locator('button[data-action="compensate:post_entry"]')).to_be_visible()
    press(page, "compensate:post_entry", "wrong amount", dialog="Undo post_entry: Post a reversing ledger entry")
    drive(run, clock)
    expect(page.locator("#run-head .state")).to_have_text("Completed, partly compensated", timeout=LIVE)
    assert page.locator("#run-head .state-completed").count() == 0
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
    assert receivers.compensations() == {"task_cancel": 0, "correction": 0, "reversal": 1}
    shot(page, "item5-partly-compensated")


# --- item 6: the runs list keeps the operator's selection across its refreshes ----------------


class RunsList:
    """The runs list of an operator, its 15 s refresh run on the page's clock by the test."""

    def __init__(self, page, live_server) -> None:
        self.page = page
        page.clock.install()  # the page's own timers, moved by the test
        page.goto(f"{live_server.url}/")

    def refresh(self) -> None:
        """The table's refresh, as the page runs it (every 15 s), swapped in."""
        replaced(self.page, "runs-table", lambda: self.page.clock.fast_forward(16_000))

    def box(self, run: WorkflowRun):
        return self.page.locator(f'input[name=run][value="{run.workflow_id}"]')

    def checked(self) -> list[str]:
        return self.page.locator("input[name=run]:checked").evaluate_all("(bs) => bs.map((b) => b.value)")


@pytest.mark.storage_agnostic
def test_item6_the_runs_list_keeps_the_checked_runs_and_the_reason_across_its_refresh(page_as, clock, live_server):
    a, b, c = (failed_early(clock, f"sel-{i}") for i in range(3))
    runs = RunsList(page_as("operator"), live_server)
    page = runs.page
    runs.box(a).check()
    runs.box(b).check()
    page.locator("#bulk-actions input[name=reason]").fill("half-typed")
    run_terminate(workflow_id=c.workflow_id, actor=None, reason="duplicate")  # the list has news
    runs.refresh()
    expect(row_of(page, c).locator(".state")).to_have_text("Terminated")  # the table was refreshed
    expect(runs.box(a)).to_be_checked()
    expect(runs.box(b)).to_be_checked()
    expect(runs.box(c)).not_to_be_checked()
    expect(page.locator("#bulk-actions input[name=reason]")).to_have_value("half-typed")
    shot(page, "item6-selection-kept-across-refresh")

    # What the bulk form then sends is that selection.
    page.locator("#bulk-actions select[name=action]").select_option("resume")
    page.get_by_role("button", name="Check first (dry run)").click()
    expect(page.locator("[data-dry-run]")).to_contain_text("2 of 2 selected runs would be changed")
    would = page.locator("details", has_text="The runs that would change").locator("tbody tr td:first-child a")
    assert sorted(would.all_inner_texts()) == [a.workflow_id, b.workflow_id]
    assert AuditEvent.objects.filter(action="resume").count() == 0
    assert states(a, b) == {a.workflow_id: RunState.FAILED, b.workflow_id: RunState.FAILED}


@pytest.mark.storage_agnostic
def test_item6_a_run_the_operator_unchecked_stays_unchecked_after_the_refresh(page_as, clock, live_server):
    a, b, c = (failed_early(clock, f"unsel-{i}") for i in range(3))
    runs = RunsList(page_as("operator"), live_server)
    runs.box(a).check()
    runs.box(b).check()
    runs.refresh()
    assert sorted(runs.checked()) == [a.workflow_id, b.workflow_id]
    runs.box(a).uncheck()  # changed their mind: not this one
    runs.refresh()
    shot(runs.page, "item6-unchecked-after-refresh")
    assert runs.checked() == [b.workflow_id], "the refresh checked again a run the operator had unchecked"


@pytest.mark.storage_agnostic
def test_item6_after_select_every_run_an_unchecked_run_and_a_new_run_stay_unchecked_after_the_refresh(
    page_as, clock, live_server
):
    a, b, c = (failed_early(clock, f"all-sel-{i}") for i in range(3))
    runs = RunsList(page_as("operator"), live_server)
    runs.page.get_by_role("button", name="Select every run on this page").click()
    for run in (a, b, c):
        expect(runs.box(run)).to_be_checked()
    runs.box(c).uncheck()
    newcomer = failed_early(clock, "all-sel-new")  # arrives after the operator chose
    runs.refresh()
    expect(runs.box(newcomer)).to_be_visible()
    shot(runs.page, "item6-select-all-then-refresh")
    assert sorted(runs.checked()) == [a.workflow_id, b.workflow_id], (
        "the refresh selected runs the operator had not chosen"
    )


# --- item 7: bulk actions with a brake ---------------------------------------------------------


def test_item7_bulk_shows_a_dry_run_changes_nothing_before_confirmation_then_applies(page_as, clock, live_server):
    f1, f2 = failed_early(clock, "bulk-1"), failed_early(clock, "bulk-2")
    done = drive(start("bulk-done"), clock)
    before = receivers.counts()
    page = page_as("operator")
    bulk = page.locator("#bulk-actions")
    # An operator may resume, pause, unpause and retry in bulk, not terminate (a supervisor's).
    assert bulk.locator("select[name=action] option").evaluate_all("(os) => os.map((o) => o.value)") == [
        "resume",
        "pause",
        "unpause",
        "retry",
    ]
    for run in (f1, f2, done):
        page.locator(f'input[name=run][value="{run.workflow_id}"]').check()
    bulk.locator("select[name=action]").select_option("resume")
    bulk.locator("input[name=reason]").fill("tracker restored")
    bulk.get_by_role("button", name="Check first (dry run)").click()

    dry = page.locator("[data-dry-run]")
    expect(dry).to_contain_text("Dry run: nothing has changed yet. 2 of 3 selected runs would be changed")
    expect(dry).to_contain_text("1 would be left untouched")
    would = page.locator("details", has_text="The runs that would change").locator("tbody tr td:first-child a")
    assert sorted(would.all_inner_texts()) == [f1.workflow_id, f2.workflow_id]
    refused = page.locator("table tbody tr", has=page.get_by_role("link", name=done.workflow_id, exact=True))
    expect(refused).to_contain_text("a finished run cannot be resumed")
    expect(page.locator("[data-action=confirm-bulk]")).to_have_text("Resume these 2 runs")
    shot(page, "item7-bulk-dry-run")
    # Nothing has changed before the confirmation.
    assert AuditEvent.objects.filter(action="resume").count() == 0
    assert states(f1, f2, done) == {
        f1.workflow_id: RunState.FAILED,
        f2.workflow_id: RunState.FAILED,
        done.workflow_id: RunState.COMPLETED,
    }

    page.locator("[data-action=confirm-bulk]").click()
    expect(page.locator(".bulk-result .flash.ok")).to_have_text("2 runs changed, each with its own audit event.")
    shot(page, "item7-bulk-applied")
    assert states(f1, f2, done) == {
        f1.workflow_id: RunState.PENDING,
        f2.workflow_id: RunState.PENDING,
        done.workflow_id: RunState.COMPLETED,
    }
    resumed = AuditEvent.objects.filter(action="resume", reason="tracker restored")
    assert sorted(resumed.values_list("run__workflow_id", flat=True)) == [f1.workflow_id, f2.workflow_id]
    assert set(resumed.values_list("actor", flat=True)) == {"operator"}
    assert receivers.counts() == before  # a resume records; the executor acts later


def test_item7_bulk_on_all_matching_runs_checks_first_and_a_cancel_changes_nothing(page_as, clock, live_server):
    failed = [failed_early(clock, f"all-{i}") for i in range(3)]
    done = drive(start("all-done"), clock)
    before = receivers.counts()
    page = page_as("operator")
    search(page, "all-", state="failed")
    assert sorted(listed(page)) == sorted(r.workflow_id for r in failed)
    bulk = page.locator("#bulk-actions")
    bulk.get_by_label("all runs matching the filter (up to 500)").check()
    bulk.locator("select[name=action]").select_option("retry")
    bulk.locator("input[name=reason]").fill("permission granted")
    bulk.get_by_role("button", name="Check first (dry run)").click()
    expect(page.locator("[data-dry-run]")).to_contain_text("3 of 3 selected runs would be changed")
    assert done.workflow_id not in page.locator("main").inner_text()

    page.get_by_role("link", name="Cancel").click()
    page.wait_for_url(lambda url: parse_qs(urlparse(url).query) == {"q": ["all-"], "state": ["failed"]})
    assert AuditEvent.objects.filter(action="retry").count() == 0
    assert set(states(*failed).values()) == {RunState.FAILED}

    bulk.get_by_label("all runs matching the filter (up to 500)").check()
    bulk.locator("select[name=action]").select_option("retry")
    bulk.locator("input[name=reason]").fill("permission granted")
    bulk.get_by_role("button", name="Check first (dry run)").click()
    page.locator("[data-action=confirm-bulk]").click()
    expect(page.locator(".bulk-result .flash.ok")).to_have_text("3 runs changed, each with its own audit event.")
    assert AuditEvent.objects.filter(action="retry", reason="permission granted").count() == 3
    assert states(done) == {done.workflow_id: RunState.COMPLETED}
    for run in failed:
        assert drive(run, clock).state == RunState.COMPLETED
    # each retried run made its task, message and entry once
    assert receivers.counts() == {k: v + (3 if k != "model_call" else 0) for k, v in before.items()}


# --- item 8: the timeline, by keyboard ------------------------------------------------------------


FOCUSED = """() => {
  const marks = [...document.querySelectorAll("svg.timeline [tabindex]")];
  const el = document.activeElement;
  if (!el || el === document.body) return {at: "body"};
  const i = marks.indexOf(el);
  if (i >= 0) return {at: "timeline", index: i, kind: el.getAttribute("class"),
                      title: el.querySelector("title").textContent};
  if (el.matches("details.timeline-events > summary")) return {at: "events"};
  return {at: el.tagName};
}"""


def tab_through(page, limit: int = 400) -> list[dict]:
    """Press Tab from the top of the page until focus comes back round; what each press focused."""
    page.locator("body").evaluate("(b) => { document.activeElement && document.activeElement.blur(); }")
    seen = []
    for _ in range(limit):
        page.keyboard.press("Tab")
        where = page.evaluate(FOCUSED)
        if where["at"] == "body" and seen:
            break
        seen.append(where)
    return seen


@pytest.mark.storage_agnostic
def test_item8_every_timeline_event_is_reachable_by_keyboard_and_operator_actions_are_marked(
    page_as, clock, live_server
):
    run = failed_early(clock, "timeline")
    clock.advance(2 * 3600 + 13 * 60)  # two hours later an operator retries
    page = page_as("operator", username="olga")
    open_run(page, live_server, run)
    press(page, "retry:create_task", "permission granted")
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    open_run(page, live_server, run)
    wait_until_the_page_stops_polling(page)

    svg = page.locator("svg.timeline")
    expect(svg.locator("text.gap-label")).to_have_text(["+2 h 13 min"])  # the quiet gap, compressed
    focusable = svg.locator("[tabindex]")
    total = focusable.count()
    bars, marks = svg.locator("rect.attempt").count(), svg.locator("circle.mark").count()
    assert total == bars + marks + svg.locator("line.operator").count()  # each attempt a bar
    assert svg.locator("line.operator").count() == 1
    titles = focusable.evaluate_all("(els) => els.map((e) => e.querySelector('title').textContent)")
    assert all(t.strip() for t in titles)

    walk = tab_through(page)
    reached = [w for w in walk if w["at"] == "timeline"]
    assert sorted(w["index"] for w in reached) == list(range(total))  # every mark, once, in order
    assert [w["index"] for w in reached] == sorted(w["index"] for w in reached)
    operator = [w for w in reached if w["kind"] == "operator"]
    assert len(operator) == 1 and operator[0]["title"].endswith("olga: retry create_task")
    assert {"at": "events"} in walk

    # The same events as a list, opened from the keyboard; the operator's action marked.
    summary = page.locator("details.timeline-events > summary")
    summary.focus()
    page.keyboard.press("Enter")
    items = page.locator("details.timeline-events li")
    expect(items.first).to_be_visible()
    assert items.count() == total + bars  # an attempt's bar is two events of the list: its start, its outcome
    expect(page.locator("details.timeline-events li.operator")).to_have_text(
        re.compile(r"^\d\d:\d\d:\d\d UTC retry create_task — by olga$")
    )
    svg.locator("line.operator").focus()
    shot(page, "item8-timeline-keyboard")
    assert AuditEvent.objects.filter(run=run, action="retry", actor="olga").count() == 1


@pytest.mark.storage_agnostic
def test_item8_on_a_run_waiting_for_a_person_the_opened_event_list_and_the_focus_survive_the_refresh(
    page_as, clock, live_server
):
    """The runs an operator reads at 3 a.m. are not finished: their page refreshes every 3 s.
    An event list opened from the keyboard, and the timeline mark in focus, must not be taken
    away by that refresh."""
    run = failed_late(clock, "timeline-live")
    page = page_as("operator")
    page.clock.install()
    open_run(page, live_server, run)

    summary = page.locator("details.timeline-events > summary")
    summary.focus()
    page.keyboard.press("Enter")
    expect(page.locator("details.timeline-events")).to_have_attribute("open", "")
    intent_row(page, "create_task").get_by_text("intent (checkpointed before the call)").click()
    expect(intent_row(page, "create_task").locator("details").first).to_have_attribute("open", "")
    page.locator("svg.timeline rect.attempt").first.focus()
    assert page.evaluate(FOCUSED)["at"] == "timeline"
    polled(page, lambda: page.clock.fast_forward(4_000))  # the page's 3 s refresh
    shot(page, "item8-timeline-after-refresh")
    after = {
        "focus": page.evaluate(FOCUSED)["at"],
        "event list open": page.locator("details.timeline-events").get_attribute("open") is not None,
        "intent open": intent_row(page, "create_task").locator("details").first.get_attribute("open") is not None,
    }
    assert after == {"focus": "timeline", "event list open": True, "intent open": True}, "the refresh took them away"
    assert states(run) == {run.workflow_id: RunState.FAILED}


# --- item 9: no dead ends -----------------------------------------------------------------------


@pytest.mark.storage_agnostic
def test_item9_a_refusal_outside_htmx_is_a_console_page_with_a_way_back(page_as, clock, live_server):
    run = failed_early(clock, "refused")
    before = receivers.counts()
    # A viewer types /demo into the address bar.
    viewer = page_as("viewer")
    assert viewer.get_by_role("navigation").get_by_role("link", name="Demo").count() == 0
    response = viewer.goto(f"{live_server.url}/demo")
    assert response.status == 403
    expect(viewer.get_by_role("heading", name="Not allowed")).to_be_visible()
    expect(viewer.locator("main .flash.error")).to_have_text(
        "Your role (viewer) may not sandbox here: that needs the supervisor role."
    )
    expect(viewer.get_by_role("navigation").get_by_role("link", name="Runs")).to_be_visible()  # the layout
    shot(viewer, "item9-refusal-page")
    viewer.get_by_role("link", name="Go back").click()
    viewer.wait_for_url(f"{live_server.url}/")
    expect(viewer.locator("table.runs")).to_be_visible()

    # An operator without JavaScript (no htmx): plain form posts. Their role is taken away after
    # the page was loaded; the retry is refused on a page of the console, with a way back.
    operator = page_as("operator", java_script_enabled=False)
    open_run(operator, live_server, run)
    form = operator.locator("form.action", has=operator.locator('button[data-action="retry:create_task"]'))
    form.locator("input[name=reason]").fill("permission granted")
    user = get_user_model().objects.get(username="operator")
    user.groups.set([Group.objects.get_or_create(name="viewer")[0]])
    with operator.expect_navigation() as nav:
        form.locator("button").click()
    assert nav.value.status == 403
    expect(operator.get_by_role("heading", name="Not allowed")).to_be_visible()
    expect(operator.locator("main .flash.error")).to_have_text(
        "Your role (viewer) may not act here: that needs the operator role."
    )
    expect(operator.locator("main")).to_contain_text("Nothing was changed.")
    shot(operator, "item9-refusal-without-htmx")
    operator.get_by_role("link", name="Go back").click()
    operator.wait_for_url(f"{live_server.url}/runs/{run.workflow_id}")
    assert offered(operator) == set()
    expect(operator.locator("section.actions")).to_contain_text(
        "You can read this run; acting on it needs the operator role."
    )

    # The role given back, but someone else acted meanwhile: 409, on a console page too.
    user.groups.set([Group.objects.get_or_create(name="operator")[0]])
    open_run(operator, live_server, run)
    form = operator.locator("form.action", has=operator.locator('button[data-action="retry:create_task"]'))
    form.locator("input[name=reason]").fill("permission granted")
    colleague = page_as("operator", username="colleague")
    open_run(colleague, live_server, run)
    press(colleague, "retry:create_task", "I have it")
    with operator.expect_navigation() as nav:
        form.locator("button").click()
    assert nav.value.status == 409
    expect(operator.get_by_role("heading", name="The run changed")).to_be_visible()
    expect(operator.get_by_role("link", name="Go back")).to_have_attribute(
        "href", f"{live_server.url}/runs/{run.workflow_id}"
    )
    assert list(AuditEvent.objects.filter(run=run, action="retry").values_list("actor", flat=True)) == ["colleague"]
    assert states(run) == {run.workflow_id: RunState.PENDING} and receivers.counts() == before


def test_item9_the_demo_link_shows_only_to_a_supervisor_and_clearing_the_sandbox_asks_first(
    page_as, clock, live_server
):
    for role in ("viewer", "operator"):
        page = page_as(role)
        assert page.get_by_role("navigation").get_by_role("link", name="Demo").count() == 0, role
    page = page_as("supervisor")
    page.on("dialog", lambda d: d.accept())  # whatever it asks, the box must be ticked
    page.get_by_role("navigation").get_by_role("link", name="Demo").click()
    page.wait_for_url(f"{live_server.url}/demo")
    faults.set_fault("tasks", "create", "forbidden", times=2)
    page.reload()
    armed = Fault.objects.using("sandbox").filter(remaining__gt=0)
    expect(page.get_by_text("tasks create: forbidden × 2")).to_be_visible()

    # Pressed without ticking the box: nothing is sent, nothing cleared.
    clear = page.locator("form.clear")
    tick = clear.get_by_role("checkbox")
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.method) if r.url.endswith("/demo") else None)
    clear.get_by_role("button", name="Clear the sandbox").click()
    assert tick.evaluate("(el) => el.validity.valueMissing") is True
    shot(page, "item9-clear-asks-first")
    assert requests == [] and armed.count() == 1

    tick.check()
    with page.expect_navigation():
        clear.get_by_role("button", name="Clear the sandbox").click()
    expect(page.locator("main > .flash")).to_have_text(
        "sandbox cleared: no faults, no tasks, messages or ledger entries"
    )
    expect(page.get_by_text("tasks create: forbidden × 2")).to_have_count(0)
    assert armed.count() == 0 and requests == ["POST"]
