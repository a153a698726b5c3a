"""The console on executor health: the dashboard's list of executors, and the banner every page
shows while none is live (on a driven clock)."""

from __future__ import annotations

import re

import pytest
from django.conf import settings
from django.urls import reverse

from recovery.engine import transitions
from recovery.engine.transitions import run_claim, run_start
from recovery.models import ExecutorMode
from tests.support.console import login

pytestmark = pytest.mark.django_db

SILENT = settings.RECOVERY_EXECUTOR_SILENT_SECONDS
BANNER = "data-executor-banner"


def pages(run) -> list[str]:
    return [reverse("console:runs"), reverse("console:dashboard"), reverse("console:run", args=[run.workflow_id])]


def test_the_banner_shows_on_every_page_while_no_executor_beats_and_goes_once_one_does(clock):
    run = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "b-1"})[0]
    viewer = login("viewer")
    for url in pages(run):  # none ever registered
        page = viewer.get(url)
        assert BANNER in page.text and "No executor has ever checked in" in page.text, url
        assert "manage.py run_executor" in page.text

    transitions.executor_register(mode=ExecutorMode.EMBEDDED, owner="host-a:11")
    last = clock.now()
    for url in pages(run):
        assert BANNER not in viewer.get(url).text, url

    clock.advance(SILENT)
    for url in pages(run):
        text = viewer.get(url).text
        assert BANNER in text, url
        assert f'No executor has checked in since <time datetime="{last.isoformat()}' in text
        assert f"{last:%Y-%m-%d %H:%M:%S} UTC" in text and "runs are not moving" in text

    # A visitor not signed in sees the login page, not the engine's health.
    assert BANNER not in viewer.__class__().get(reverse("login")).text


def test_an_htmx_part_reads_nothing_of_the_executors(clock):
    viewer = login("viewer")
    part = viewer.get(reverse("console:runs"), headers={"HX-Request": "true", "HX-Target": "runs-table"})
    assert BANNER not in part.text


def test_the_dashboard_lists_each_executor_with_its_beat_and_the_runs_it_holds(clock):
    run = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "held"})[0]
    transitions.executor_register(mode=ExecutorMode.EMBEDDED, owner="host-a:11")
    transitions.executor_register(mode=ExecutorMode.CELERY, owner="host-b:22")
    clock.advance(SILENT)  # host-b goes silent; host-a beats, and holds the run (a live lease)
    transitions.executor_beat(mode=ExecutorMode.EMBEDDED, owner="host-a:11")
    assert run_claim(run_pk=run.pk, owner="host-a:11") is not None
    clock.advance(3)

    text = login("viewer").get(reverse("console:dashboard")).text
    rows = dict(re.findall(r'<tr data-executor="([^"]+)" class="([^"]*)">', text))
    assert rows == {"host-a:11": "", "host-b:22": "silent"}
    a = text.split('data-executor="host-a:11"', 1)[1].split("</tr>", 1)[0]
    b = text.split('data-executor="host-b:22"', 1)[1].split("</tr>", 1)[0]
    assert "<td>host-a</td>" in a and ">11<" in a and "embedded loop" in a and "3 s ago" in a and "UTC" in a
    assert 'data-runs-held="1"' in a and ">live<" in a
    assert "<td>host-b</td>" in b and "celery worker" in b and f"{int(SILENT) + 3} s ago" in b
    assert 'data-runs-held="0"' in b and ">silent<" in b
    assert "0.1.0" in a and "test_orders v" in a  # the code's version and the workflows it has
    assert BANNER not in text  # host-a is live
