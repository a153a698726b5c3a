"""Issue 33, "No executor, no sign", in a real browser (Debian's Chromium driven by Playwright): an
executor registered, then silent past RECOVERY_EXECUTOR_SILENT_SECONDS (the engine's clock is
moved; the live server reads it too). Every page shows the banner, the dashboard marks the
executor silent, and the run that waits for one is counted under "No executor"."""

from __future__ import annotations

import re

import pytest
from django.conf import settings
from playwright.sync_api import expect

from recovery.engine import transitions
from recovery.engine.transitions import run_start
from recovery.models import ExecutorMode, RunState
from tests.browser.conftest import needs_chromium, shot

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=["default", "sandbox"]),
    needs_chromium,
]

SILENT = settings.RECOVERY_EXECUTOR_SILENT_SECONDS


def test_a_silent_executor_shows_a_banner_everywhere_and_its_runs_count_as_no_executor(page_as, live_server, clock):
    run = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "no-exec"})[0]
    transitions.executor_register(mode=ExecutorMode.EMBEDDED, owner="host-a:4242")
    last_beat = clock.now()
    page = page_as("operator")
    banner = page.locator("[data-executor-banner]")

    page.goto(f"{live_server.url}/dashboard")
    expect(page.locator('tr[data-executor="host-a:4242"]')).to_contain_text("live")
    expect(banner).to_have_count(0)  # while it beats: no banner

    clock.advance(SILENT + 1)  # the executor went silent; the run has waited that long

    page.goto(f"{live_server.url}/dashboard")
    expect(banner).to_be_visible()
    expect(banner).to_contain_text(f"No executor has checked in since {last_beat:%Y-%m-%d %H:%M:%S} UTC")
    expect(banner).to_contain_text("runs are not moving")
    expect(banner).to_contain_text("manage.py run_executor")
    row = page.locator('tr[data-executor="host-a:4242"]')
    expect(row).to_have_class(re.compile(r"\bsilent\b"))
    expect(row).to_contain_text(f"{int(SILENT) + 1} s ago")
    shot(page, "issue33-no-executor-dashboard")

    page.goto(f"{live_server.url}/runs/{run.workflow_id}")
    expect(banner).to_be_visible()
    expect(page.locator("body")).to_contain_text("but no executor is running")
    shot(page, "issue33-no-executor-run")

    page.goto(f"{live_server.url}/")
    expect(banner).to_be_visible()
    chip = page.locator(".chips.stuck a.chip", has_text=re.compile(r"^No executor\s"))
    expect(chip.locator("b")).to_have_text("1")
    chip.click()
    page.wait_for_url("**/?stuck=no_executor")
    expect(page.locator("body")).to_contain_text(run.workflow_id)
    shot(page, "issue33-no-executor-list")

    # An executor beats again: the banner goes, and the run is no longer counted there.
    transitions.executor_beat(mode=ExecutorMode.EMBEDDED, owner="host-a:4242")
    page.goto(f"{live_server.url}/")
    expect(banner).to_have_count(0)
    expect(chip.locator("b")).to_have_text("0")
    run.refresh_from_db()
    assert run.state == RunState.PENDING  # nothing here moved it: only what the pages say changed
