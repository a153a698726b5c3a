"""Pages an operator meets off the happy path (issue 33): an unknown run id is the console's own
404 with a search, also under DJANGO_DEBUG; the audit export's refusals are the console's
refusal page for a browser and one plain line for scripts."""

import re

import pytest
from django.urls import reverse

from recovery.models import AuditEvent, WorkflowRun
from tests.support.console import act, failed_run, login, unknown_run

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])

BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


@pytest.mark.parametrize("debug", [False, True])
def test_an_unknown_run_id_is_the_consoles_404_with_a_search_and_the_close_runs(clock, settings, debug):
    settings.DEBUG = debug  # DEBUG answers a raised Http404 with Django's technical page
    near = failed_run(clock, "o-1")
    response = login("viewer").get(reverse("console:run", args=["order:t:o-9"]), headers=BROWSER)
    assert response.status_code == 404
    assert [t.name for t in response.templates][:2] == ["console/not_found.html", "base.html"]
    text = response.text
    assert "<h1>No run order:t:o-9</h1>" in text and 'class="brand"' in text
    assert f'action="{reverse("console:runs")}"' in text and 'name="q" value="order:t:o-9"' in text
    assert f'href="{reverse("console:run", args=[near.workflow_id])}"' in text  # same prefix "order:t:"
    assert "technical_404" not in text and "Using the URLconf" not in text


def test_the_404s_close_runs_include_the_same_id_in_another_case(clock):
    run = failed_run(clock, "INV-7")
    response = login("viewer").get(reverse("console:run", args=["ORDER:T:inv-7"]))
    assert response.status_code == 404 and response.context["close"] == [run]


def test_the_api_still_answers_json_for_what_it_does_not_know(settings):
    settings.DEBUG = True
    response = login("supervisor").post("/api/events/nope", "{}", content_type="application/json")
    assert response.status_code in (401, 404) and response["Content-Type"].startswith("application/json")
    assert "error" in response.json()


# --- the audit export's refusals --------------------------------------------------------------


@pytest.mark.parametrize(
    "params,status,message",
    [
        ({"format": "xml"}, 400, "unknown format &#x27;xml&#x27;"),
        ({"since": "soon"}, 400, "since: &#x27;soon&#x27; is not an ISO 8601 date"),
        ({"run": "order:t:nope"}, 404, "no run &#x27;order:t:nope&#x27;"),
    ],
)
def test_an_export_refused_in_a_browser_is_the_consoles_refusal_page(params, status, message):
    before = AuditEvent.objects.count()
    response = login("viewer").get(reverse("console:audit-export"), params, headers=BROWSER)
    assert response.status_code == status and not response.streaming
    assert response["Content-Type"].startswith("text/html")
    assert [t.name for t in response.templates][:2] == ["console/refusal.html", "base.html"]
    assert message in response.text and "The audit trail was not exported" in response.text
    assert "Nothing was changed" in response.text and AuditEvent.objects.count() == before


def test_an_export_forbidden_in_a_browser_is_the_refusal_page_with_403():
    response = login(None).get(reverse("console:audit-export"), {"format": "csv"}, headers=BROWSER)
    assert response.status_code == 403 and response["Content-Type"].startswith("text/html")
    assert "<h1>Not allowed</h1>" in response.text and "You may not export the audit trail." in response.text


@pytest.mark.parametrize("accept", [None, "*/*", "application/json", "text/plain", "application/json, text/html"])
def test_scripts_keep_the_one_plain_line(accept):
    headers = {"Accept": accept} if accept else {}
    response = login("viewer").get(reverse("console:audit-export"), {"run": "order:t:nope"}, headers=headers)
    assert response.status_code == 400 and response["Content-Type"] == "text/plain; charset=utf-8"
    assert response.content.decode() == "no run 'order:t:nope'\n"


# --- the demo page ----------------------------------------------------------------------------


def test_the_demo_page_links_the_run_it_started():
    supervisor = login("supervisor")
    data = {"what": "start", "invoice_id": "inv-2001", "text": "Monitor and docking station. Total due EUR 640.00"}
    response = supervisor.post(reverse("demo"), data)
    run = WorkflowRun.objects.get()
    assert response.status_code == 200 and run.workflow_id == "invoice:demo:inv-2001"
    link = f'href="{reverse("console:run", args=[run.workflow_id])}" data-started-run'
    assert link in response.text
    again = supervisor.post(reverse("demo"), data)  # the same invoice: the same run, linked again
    assert "already running: invoice:demo:inv-2001" in again.text and link in again.text
    assert WorkflowRun.objects.count() == 1
    refused = supervisor.post(reverse("demo"), {**data, "invoice_id": ""})
    assert refused.status_code == 400 and "data-started-run" not in refused.text


# --- operator text: labels, never internal names; every time with its zone -----------------------


def test_an_action_and_its_history_read_as_labels_with_times_in_their_zone(clock, monkeypatch):
    run = unknown_run(clock, monkeypatch)
    response = act(login("supervisor"), run, "resolve_absent", step="notify", reason="not in the messenger's outbox")
    assert response.status_code == 200, response.text
    flash = re.search(r'class="flash ok"[^>]*>([^<]*)<', response.text).group(1)
    run.refresh_from_db()
    assert flash == f"mark not happened (notify) recorded; the run is now {run.get_state_display().lower()}"
    history = response.text.split('id="run-history"')[1]
    actions = re.findall(r"<td>u-supervisor</td>\s*<td>([^<]*)</td>|<td>executor</td>\s*<td>([^<]*)</td>", history)
    actions = [a or b for a, b in actions]
    # the audit vocabulary's labels (recovery.states.AuditAction): resolve, the engine's step_unknown
    assert "outcome settled by an operator" in actions and "outcome unknown" in actions
    assert all("_" not in a for a in actions)
    cells = re.findall(r'<td title="[^"]+">([^<]+)</td>', history)
    assert cells and all(c.endswith(" UTC") for c in cells)
    versions = re.findall(r"<tr><td>(\d{4}-\d\d-\d\d [\d:]+ [A-Z]+)</td><td>[^<]*</td><td>([^<]*)</td>", history)
    assert versions and all(when.endswith(" UTC") for when, _ in versions)
    assert all("_" not in state for _, state in versions)  # "Needs Review", not needs_review
    listed = re.findall(r'<time datetime="[^"]+">([^<]+)</time>', response.text.split("timeline-events")[1])
    assert listed and all(t.endswith(" UTC") for t in listed)
