"""Every time people read carries its zone (issue 33): the why-sentence (list, run page, alerts,
``show_run``) and ``show_run``'s audit lines say "14:03:10 UTC"; machine outputs (``--json``)
keep ISO 8601 as they were."""

import json
import re
from io import StringIO

import pytest
from django.core.management import call_command

from recovery.engine.executor import advance
from recovery.engine.transitions import run_start
from tests.support import receivers

pytestmark = pytest.mark.django_db(transaction=True)


def show(*args: str) -> str:
    out = StringIO()
    call_command("show_run", *args, stdout=out)
    return out.getvalue()


def test_show_run_prints_each_time_with_its_zone_and_its_json_keeps_iso(clock):
    receivers.arm("task", "rate_limit")
    run = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "zone"})[0]
    advance(run.pk)
    run.refresh_from_db()

    text = show(run.workflow_id)
    why = next(line for line in text.splitlines() if line.startswith("  why: "))
    assert f"retrying create_task at {run.next_wake_at:%H:%M:%S} UTC (attempt 2 of 4;" in why
    trail = text.split("oldest first):\n")[1].splitlines()
    events = [line for line in trail if re.match(r"^    \d{4}-", line)]
    assert len(events) == run.audit_events.count()
    first = run.audit_events.order_by("at", "id").first()
    assert events[0].startswith(f"    {first.at:%Y-%m-%d %H:%M:%S} UTC  executor ")
    assert all(re.match(r"^    \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC  ", line) for line in events)

    doc = json.loads(show(run.workflow_id, "--json"))  # for scripts: unchanged
    assert doc["audit"][0]["at"] == first.at.isoformat() and "UTC" not in doc["audit"][0]["at"]
    assert doc["why"] == why.removeprefix("  why: ")
