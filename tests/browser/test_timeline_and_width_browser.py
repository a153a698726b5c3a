"""Issue 33, in a real browser (Debian's Chromium driven by Playwright): the run page's timeline
draws each attempt as a bar as long as it took and never lets two gap labels overlap; the
dashboard, the runs list and a run page are usable 820 px wide (the page itself never scrolls
sideways; a wide table scrolls inside its own box). Screenshots under var/screenshots/.

Time: the engine runs on the ``clock`` fixture. The frozen test clock gives every attempt the
engine makes no length, so the retries of the timeline test are written into the run's audit
trail as the engine writes them (``step_begin``, then the outcome), at the times chosen."""

from __future__ import annotations

from datetime import timedelta
from itertools import combinations

import pytest
from playwright.sync_api import expect

from recovery.models import AuditEvent, RunState, WorkflowRun
from tests.browser.conftest import needs_chromium, shot
from tests.browser.test_agent_console import waiting_agent
from tests.browser.test_operator_console_items import failed_early, offered, open_run, row_of

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=["default", "sandbox"]),
    needs_chromium,
    pytest.mark.storage_agnostic,  # markup, scripts, policy, layout: CI runs it on PostgreSQL only
]

NARROW = {"width": 820, "height": 900}

# (seconds after the previous attempt's outcome, how long the attempt took, its outcome): four
# retries seconds apart, then attempts minutes apart whose compressed gaps lie side by side.
ATTEMPTS = [
    (60, 0.5, "step_fail"),
    (2, 1.5, "step_fail"),
    (3, 3.2, "step_fail"),
    (5, 6.0, "step_fail"),
    (8 * 60, 0.8, "step_fail"),
    (9 * 60, 1.0, "step_fail"),
    (12 * 60, 2.0, "step_fail"),
    (40 * 60, 2.4, "step_succeed"),
]


def retried(run: WorkflowRun) -> list[float]:
    """``ATTEMPTS`` of create_task added to the run's audit trail; their lengths in seconds."""
    at = run.audit_events.order_by("-at").first().at
    events = []
    for pause, took, outcome in ATTEMPTS:
        at += timedelta(seconds=pause)
        for action, when in (("step_begin", at), (outcome, at + timedelta(seconds=took))):
            events.append(
                AuditEvent(run=run, at=when, step_name="create_task", actor="executor", action=action, reason="")
            )
        at += timedelta(seconds=took)
    AuditEvent.objects.bulk_create(events)
    return [took for _, took, _ in ATTEMPTS]


def boxes(locator) -> list[dict]:
    return locator.evaluate_all(
        "(els) => els.map((e) => { const r = e.getBoundingClientRect();"
        " return {left: r.left, right: r.right, top: r.top, bottom: r.bottom, text: e.textContent}; })"
    )


def intersect(a: dict, b: dict) -> bool:
    return a["left"] < b["right"] and b["left"] < a["right"] and a["top"] < b["bottom"] and b["top"] < a["bottom"]


def test_each_attempt_is_a_bar_as_long_as_it_took_and_no_two_gap_labels_overlap(page_as, clock, live_server):
    run = failed_early(clock, "bars")  # the engine's own attempts (the last a 403): no length on the frozen clock
    made = run.audit_events.filter(action="step_begin").count()
    lengths = retried(run)
    page = page_as("viewer")
    open_run(page, live_server, run)

    svg = page.locator("svg.timeline")
    bars = svg.locator("rect.attempt")
    expect(bars).to_have_count(made + len(lengths))  # every attempt, the engine's too, is a bar
    expect(svg.locator("circle.mark")).to_have_count(0)  # and none is a point any more
    drawn = bars.evaluate_all(
        "(els) => els.map((e) => ({seconds: Number(e.dataset.seconds), width: Number(e.getAttribute('width')),"
        " title: e.querySelector('title').textContent}))"
    )
    assert sorted(d["seconds"] for d in drawn) == sorted([0.0] * made + lengths)
    by_length = sorted(drawn, key=lambda d: d["seconds"])
    widths = [d["width"] for d in by_length]
    assert widths == sorted(widths), f"a longer attempt drawn narrower: {by_length}"
    burst = [next(d["width"] for d in drawn if d["seconds"] == s) for s in (1.5, 3.2, 6.0)]
    assert burst[0] < burst[1] < burst[2]  # seconds apart, each as long as it took
    assert any("attempt of 3.2 s, then step_fail" in d["title"] for d in drawn)

    labels = svg.locator("text.gap-label")
    expect(labels).to_have_text(["+8 min", "+9 min", "+12 min", "+40 min"])
    placed = boxes(labels)
    overlapping = [(a["text"], b["text"]) for a, b in combinations(placed, 2) if intersect(a, b)]
    assert not overlapping, f"gap labels overlap: {overlapping}"
    frame = svg.evaluate(
        "(s) => { const r = s.getBoundingClientRect(); return {left: r.left, right: r.right,"
        " top: r.top, bottom: r.bottom}; }"
    )
    assert all(
        frame["left"] <= b["left"] and b["right"] <= frame["right"] and b["bottom"] <= frame["bottom"] for b in placed
    )  # inside the drawing, none cut off
    ticks = svg.locator("text.axis").evaluate_all("(els) => els.map((e) => e.textContent)")
    assert ticks and all(t.endswith(" UTC") for t in ticks)
    shot(page, "timeline-bars-and-gap-labels")
    assert run.audit_events.filter(actor_user__isnull=False).count() == 0  # reading changed nothing


def no_sideways_scroll(page) -> dict:
    return page.evaluate(
        "() => ({page: document.documentElement.scrollWidth, view: window.innerWidth,"
        " wide: [...document.querySelectorAll('table')].filter((t) => t.getBoundingClientRect().right > innerWidth)"
        ".filter((t) => !t.closest('.scroll')).map((t) => t.className || t.parentElement.className)})"
    )


def test_the_dashboard_the_runs_list_and_a_run_page_are_usable_820_px_wide(page_as, clock, live_server):
    failed = failed_early(clock, "narrow-a-rather-long-order-identifier-as-tenants-write-them")
    agent = waiting_agent("narrow")
    page = page_as("operator", viewport=NARROW)

    expect(row_of(page, failed)).to_be_visible()
    on_list = no_sideways_scroll(page)
    shot(page, "narrow-runs-list")

    page.goto(f"{live_server.url}/dashboard")
    expect(page.locator("h1")).to_have_text("Dashboard")
    on_dashboard = no_sideways_scroll(page)
    shot(page, "narrow-dashboard")

    open_run(page, live_server, agent)
    expect(page.locator('section.conversation[data-agent="resolve"]')).to_be_visible()
    assert "stop_agent:resolve" in offered(page)  # the actions section is there
    on_run = no_sideways_scroll(page)
    shot(page, "narrow-run-page")

    for name, seen in (("runs list", on_list), ("dashboard", on_dashboard), ("run page", on_run)):
        assert seen["page"] <= NARROW["width"], f"the {name} scrolls sideways: {seen}"
        assert not seen["wide"], f"the {name} has tables wider than the window outside a scroll box: {seen}"
    # The wide tables scroll inside their own box: that box, not the page, is wider inside.
    inner = page.locator(".scroll").evaluate_all("(els) => els.map((e) => e.scrollWidth > e.clientWidth)")
    assert any(inner), "no table needed its own scroll box on the run page"
    assert WorkflowRun.objects.get(pk=agent.pk).state == RunState.WAITING  # reading changed nothing
