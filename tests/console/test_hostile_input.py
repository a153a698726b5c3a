"""Hostile input (issue 7): text that nobody here wrote — model output, invoice text, remote
errors, reasons, ids — is shown escaped on every page under a Content-Security-Policy without
'unsafe-inline', and input the database cannot take is a clear 4xx that writes nothing, never
a 500. The browser half is tests/browser/test_hostile_browser.py; the fuzzing is
tests/console/test_fuzz_input.py."""

import json
import re

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils.html import escape

from recovery.api.tokens import issue_token
from recovery.console.selectors import RunFilters
from recovery.engine.transitions import run_version
from recovery.models import ApiToken, AuditEvent, StepExecution, StepState, WorkflowRun
from sandbox.models import Fault
from tests.support import hostile
from tests.support.console import act, failed_run, login, unknown_run

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])

POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'; object-src 'none'"
)


def written() -> tuple[int, int, int, list]:
    return (
        WorkflowRun.objects.count(),
        StepExecution.objects.count(),
        AuditEvent.objects.count(),
        list(StepExecution.objects.order_by("pk").values_list("state", "remote_ref", "attempts")),
    )


# --- Content-Security-Policy --------------------------------------------------------------


def test_every_console_page_the_login_page_and_the_admin_carry_the_policy(clock):
    """No 'unsafe-inline', no 'unsafe-eval', no nonce on the console's own pages: scripts and
    styles come only from our static files."""
    run = failed_run(clock)
    supervisor = login("supervisor")
    pages = [
        reverse("console:runs"),
        reverse("console:runs") + "?stuck=any",
        reverse("console:run", args=[run.workflow_id]),
        reverse("console:dashboard"),
        reverse("demo"),
    ]
    for url in pages:
        response = supervisor.get(url)
        assert response.status_code == 200, url
        assert response["Content-Security-Policy"] == POLICY, url
        assert "Content-Security-Policy-Report-Only" not in response
        assert "{#" not in response.text and "{%" not in response.text  # no template source leaks into a page
    htmx = supervisor.get(reverse("console:runs"), headers={"HX-Request": "true", "HX-Target": "runs-table"})
    assert htmx["Content-Security-Policy"] == POLICY
    bulk = supervisor.post(reverse("console:bulk"), {"action": "resume", "reason": "r", "run": [run.workflow_id]})
    assert bulk.status_code == 200 and bulk["Content-Security-Policy"] == POLICY
    assert Client().get(reverse("login"))["Content-Security-Policy"] == POLICY
    assert Client().get(reverse("console:runs"))["Content-Security-Policy"] == POLICY  # the redirect too


def test_the_admin_is_under_the_same_policy_with_a_nonce_only_for_its_own_inline_styles():
    admin = get_user_model().objects.create_superuser("root", password="pw")
    client = Client()
    client.force_login(admin)
    for url in ["/admin/", "/admin/recovery/workflowrun/", "/admin/auth/user/", f"/admin/auth/user/{admin.pk}/change/"]:
        response = client.get(url)
        assert response.status_code == 200, url
        policy = response["Content-Security-Policy"]
        # The same directives; the admin's templates may add a per-request nonce to style-src.
        assert re.sub(r" 'nonce-[A-Za-z0-9_-]+'", "", policy) == POLICY, url
        assert "unsafe" not in policy and "script-src 'self';" in policy
        nonce = re.search(r"'nonce-([A-Za-z0-9_-]+)'", policy)
        if nonce:
            assert f'nonce="{nonce.group(1)}"' in response.text  # used by the page it was made for


def test_the_templates_hold_no_inline_script_style_or_event_handler():
    """What the policy would block must not be in our templates in the first place."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "templates"
    for path in root.rglob("*.html"):
        text = path.read_text()
        assert not re.search(r"<script(?![^>]*\bsrc=)", text), f"inline <script> in {path}"
        assert "<style" not in text and not re.search(r"\sstyle=", text), f"inline style in {path}"
        assert not re.search(r"\son[a-z]+=", text), f"inline event handler in {path}"
        assert "javascript:" not in text
        assert "|safe" not in text and "autoescape off" not in text, f"escaping turned off in {path}"
    base = (root / "base.html").read_text()
    config = json.loads(re.search(r"name=\"htmx-config\" content='([^']+)'", base).group(1))
    assert config["allowEval"] is False and config["allowScriptTags"] is False
    assert config["includeIndicatorStyles"] is False and config["selfRequestsOnly"] is True


# --- hostile text renders escaped ---------------------------------------------------------------


def test_hostile_text_in_every_field_of_the_run_page_is_escaped(clock, monkeypatch):
    planted = hostile.plant(clock, monkeypatch)
    client = Client()
    client.force_login(get_user_model().objects.get(username=planted.actor))
    page = client.get(reverse("console:run", args=[planted.resolved.workflow_id]))
    assert page.status_code == 200
    hostile.assert_escaped(page.text, planted.on_run_page)
    assert escape('(given: "' + hostile.SCRIPT[:20]) in page.text  # the kept validation error, what was given
    assert f"<span>{escape(planted.actor)}</span>" in page.text  # the logged-in operator's name

    other = client.get(reverse("console:run", args=[planted.hostile_id.workflow_id]))
    assert other.status_code == 200
    hostile.assert_escaped(other.text, [planted.hostile_id.workflow_id, planted.hostile_id.business_key])
    assert 'data-action="retry:create_task"' in other.text  # its action forms are rendered
    assert f'value="{escape(run_version(planted.hostile_id))}"' in other.text


def test_hostile_text_in_the_runs_list_its_filters_and_its_cursor_is_escaped(clock, monkeypatch):
    planted = hostile.plant(clock, monkeypatch)
    supervisor = login("supervisor")
    listing = supervisor.get(reverse("console:runs"))
    hostile.assert_escaped(listing.text, planted.on_list_page)
    assert f'value="{escape(planted.hostile_id.workflow_id)}"' in listing.text  # the bulk checkbox

    echoed = supervisor.get(reverse("console:runs"), {"q": hostile.ALL, "key": hostile.ALL, "workflow": hostile.IMG})
    assert echoed.status_code == 200
    assert f'name="q" value="{escape(hostile.ALL)}"' in echoed.text
    assert f'name="key" value="{escape(hostile.ALL)}"' in echoed.text
    assert f'<input type="hidden" name="q" value="{escape(hostile.ALL)}">' in echoed.text  # kept by the bulk form
    hostile.assert_escaped(echoed.text, [])
    found = supervisor.get(reverse("console:runs"), {"q": planted.hostile_id.workflow_id})
    hostile.assert_escaped(found.text, [planted.hostile_id.workflow_id])
    assert escape(planted.resolved.workflow_id) not in found.text  # the search did filter


def test_hostile_text_on_the_bulk_result_flash_messages_and_the_demo_page_is_escaped(clock, monkeypatch):
    planted = hostile.plant(clock, monkeypatch)
    supervisor = login("supervisor")
    missing = "order:t:" + hostile.ALL + "missing"
    data = {
        "action": "retry",
        "reason": hostile.ALL,
        "run": [planted.hostile_id.workflow_id, missing],
        "q": hostile.IMG,
    }
    preview = supervisor.post(reverse("console:bulk"), data)
    assert preview.status_code == 200
    hostile.assert_escaped(preview.text, [missing, planted.hostile_id.workflow_id, hostile.ALL])
    assert AuditEvent.objects.filter(action="retry", reason=hostile.ALL).count() == 0
    result = supervisor.post(reverse("console:bulk"), {**data, "confirm": "yes"})
    assert result.status_code == 200
    hostile.assert_escaped(result.text, [missing, planted.hostile_id.workflow_id])
    assert AuditEvent.objects.filter(action="retry", reason=hostile.ALL).count() == 1

    planted.hostile_id.refresh_from_db()  # the bulk retry changed it
    unknown = act(supervisor, planted.hostile_id, hostile.ALL)
    assert unknown.status_code == 400 and unknown["HX-Retarget"] == "#flash"
    hostile.assert_escaped(unknown.text, [f"unknown action {hostile.ALL!r}"])
    not_waiting = act(supervisor, planted.hostile_id, "reconcile", step=hostile.SVG)
    assert not_waiting.status_code == 400
    hostile.assert_escaped(not_waiting.text, [f"run {planted.hostile_id.workflow_id} has no step {hostile.SVG!r}"])

    Fault.objects.using("sandbox").create(service="tasks", operation=hostile.SCRIPT[:16], mode=hostile.ALL[:32])
    demo = supervisor.get(reverse("demo"))
    hostile.assert_escaped(demo.text, [hostile.SCRIPT[:16], hostile.ALL[:32]])
    refused = supervisor.post(reverse("demo"), {"what": "fault", "target": "tasks create", "mode": hostile.IMG})
    assert refused.status_code == 400
    hostile.assert_escaped(refused.text, [f"unknown mode {hostile.IMG!r}"])
    start = supervisor.post(reverse("demo"), {"what": "start", "invoice_id": hostile.ATTR, "text": "x"})
    assert start.status_code == 400
    hostile.assert_escaped(start.text, [])


def test_the_export_names_its_file_from_a_hostile_run_id_safely_and_errors_are_plain_text(clock, monkeypatch):
    planted = hostile.plant(clock, monkeypatch)
    viewer = login("viewer")
    response = viewer.get(reverse("console:audit-export"), {"format": "csv", "run": planted.hostile_id.workflow_id})
    assert response.status_code == 200
    disposition = response["Content-Disposition"]
    assert re.fullmatch(r'attachment; filename="audit-[A-Za-z0-9_.-]+-\d{8}T\d{6}Z\.csv"', disposition)
    b"".join(response.streaming_content)
    missing = viewer.get(reverse("console:audit-export"), {"run": hostile.ALL + "\r\nX-Injected: 1"})
    assert missing.status_code == 400
    assert missing["Content-Type"].startswith("text/plain") and missing["X-Content-Type-Options"] == "nosniff"
    assert "X-Injected" not in missing.headers


# --- NUL characters: a 400 before any view, whatever the database -----------------------------


def test_a_nul_character_in_a_query_form_or_path_is_a_400_that_writes_nothing(clock):
    """PostgreSQL refuses U+0000 in text (a 500 before the fix); SQLite would store it."""
    run = failed_run(clock)
    supervisor = login("supervisor")
    before = written()
    for response in [
        supervisor.get(reverse("console:runs"), {"q": "order\x00"}),
        supervisor.get(reverse("console:runs"), {"key\x00": "x"}),
        supervisor.get("/runs/order:t%00x"),
        supervisor.get(reverse("console:audit-export"), {"actor": "a\x00"}),
        act(supervisor, run, "retry", step="create_task", reason="why\x00", htmx=False),
        supervisor.post(reverse("console:bulk"), {"action": "resume", "reason": "r", "run": ["x\x00"]}),
        supervisor.post(reverse("demo"), {"what": "start", "invoice_id": "i", "text": "t\x00"}),
        Client().post(reverse("login"), {"username": "u\x00", "password": "p"}),
    ]:
        assert response.status_code == 400
        assert "NUL character" in response.text
    flash = act(supervisor, run, "retry", step="create_task\x00")
    assert flash.status_code == 400 and flash["HX-Retarget"] == "#flash" and "NUL character" in flash.text
    api = Client().get("/sandbox/tasks/", {"idempotency_key": "k\x00"})
    assert api.status_code == 400 and "NUL character" in api.json()["error"]
    assert written() == before
    assert not Fault.objects.using("sandbox").exists()


# --- limits on operator input -------------------------------------------------------------------


def test_a_reason_over_2000_characters_is_refused_with_a_message_and_2000_are_kept(clock):
    run = failed_run(clock)
    supervisor = login("supervisor")
    before = written()
    refused = act(supervisor, run, "retry", step="create_task", reason="r" * 2001)
    assert refused.status_code == 400 and "at most 2,000" in refused.text
    bulk = supervisor.post(
        reverse("console:bulk"), {"action": "resume", "reason": "b" * 2001, "run": [run.workflow_id]}
    )
    assert bulk.status_code == 400 and "at most 2,000" in bulk.text
    assert written() == before
    accepted = act(supervisor, run, "retry", step="create_task", reason="r" * 2000)
    assert accepted.status_code == 200
    assert AuditEvent.objects.get(action="retry").reason == "r" * 2000


def test_an_evidence_reference_longer_than_the_column_is_a_400_not_a_database_error(clock, monkeypatch):
    run = unknown_run(clock, monkeypatch)
    monkeypatch.undo()
    operator = login("operator")
    before = written()
    response = act(operator, run, "resolve_happened", step="notify", remote_ref="m" * 256)
    assert response.status_code == 400 and "at most 255 characters" in response.text
    assert written() == before
    # One that fits the column is asked of the receiver, which has no such message: refused too.
    fits = act(operator, run, "resolve_happened", step="notify", remote_ref="m" * 255)
    assert fits.status_code == 400 and "the receiver has no" in fits.text
    assert written() == before and run.steps.get(step_name="notify").state == StepState.UNKNOWN


@pytest.mark.parametrize("after", ["²", "١٢", "9" * 30, str(2**63), "-1", "1e3"])
def test_a_cursor_that_is_not_a_run_id_shows_the_first_page(clock, after):
    """ "²".isdigit() is True but int("²") raises; 2**63 overflows SQLite's integer (500s before)."""
    run = failed_run(clock)
    assert RunFilters.from_params({"after": after}).after is None
    response = login("viewer").get(reverse("console:runs"), {"after": after})
    assert response.status_code == 200 and escape(run.workflow_id) in response.text


@pytest.mark.parametrize(
    "field,value", [("times", "9" * 20), ("times", str(2**31)), ("retry_after", "86401"), ("delay_ms", "600001")]
)
def test_a_demo_fault_number_out_of_range_is_a_400_that_arms_nothing(field, value):
    data = {"what": "fault", "target": "tasks create", "mode": "slow", field: value}
    response = login("supervisor").post(reverse("demo"), data)
    assert response.status_code == 400 and f"{field} must be an integer from" in response.text
    assert not Fault.objects.using("sandbox").exists()


# --- the ingestion API ------------------------------------------------------------------------


@pytest.fixture
def token() -> str:
    return issue_token(name="erp", workflow_name="invoice")[1]


def api_post(body, token, url="/api/events/invoice", **extra):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return Client().post(
        url, data=data, content_type="application/json", headers={"Authorization": f"Bearer {token}"}, **extra
    )


EVENT = {"tenant": "t", "invoice_id": "inv-1", "text": "chairs"}


@pytest.mark.parametrize(
    "body,message",
    [
        ('{"tenant": "t", "invoice_id": "inv-1", "text": "a\\u0000b"}', "NUL character"),
        ('{"tenant": "t", "invoice_id": "inv-1", "text": "x", "k\\u0000": 1}', "NUL character"),
        ('{"tenant": "t", "invoice_id": "inv-1", "text": "\\ud800"}', "lone surrogate"),
        ('{"tenant": "t", "invoice_id": "inv-1", "text": "x", "amount": 1e400}', "out of range"),
        ('{"tenant": "t", "invoice_id": "inv-1", "text": "x", "deep": ' + "[" * 40 + "]" * 40 + "}", "nested deeper"),
    ],
    ids=["nul-value", "nul-key", "lone-surrogate", "infinite-number", "deep"],
)
def test_json_the_database_cannot_store_is_a_400_with_a_message_and_writes_nothing(token, body, message):
    """Each was a 500 on PostgreSQL (or a RecursionError in the encoder) before the fix."""
    response = api_post(body, token)
    assert response.status_code == 400
    assert message in response.json()["error"]
    assert not WorkflowRun.objects.exists() and not AuditEvent.objects.exists()


def test_nesting_up_to_the_limit_is_accepted(token):
    body = {**EVENT, "deep": json.loads("[" * 31 + "]" * 31)}
    assert api_post(body, token).status_code == 201


def test_a_workflow_id_longer_than_the_column_is_a_400():
    orders = issue_token(name="orders", workflow_name="test_orders")[1]
    response = api_post({"tenant": "t", "order_id": "x" * 300}, orders, url="/api/events/test_orders")
    assert response.status_code == 400 and "at most 255" in response.json()["error"]
    assert not WorkflowRun.objects.exists()
    assert api_post({"tenant": "t", "order_id": "x" * 247}, orders, url="/api/events/test_orders").status_code == 201


@pytest.mark.parametrize("length", ["-1", "abc", str(10**30), "0"])
def test_a_lying_content_length_is_a_clear_4xx(token, length):
    response = api_post(EVENT, token, CONTENT_LENGTH=length)
    assert response.status_code in (400, 413)
    assert response.json()["error"]
    assert not WorkflowRun.objects.exists()
    assert ApiToken.objects.count() == 1


def test_a_wrong_method_is_a_405_that_says_which_method_to_use(clock):
    """Found by the fuzzer: POST /runs//act reaches the run page (GET only) with an empty 405."""
    supervisor = login("supervisor")
    for response, allowed in [
        (supervisor.post("/runs//act", {"action": "resume"}), ["GET", "HEAD"]),  # a page reads with either
        (supervisor.get(reverse("console:bulk")), ["POST"]),
        (supervisor.post(reverse("console:audit-export")), ["GET"]),
    ]:
        assert response.status_code == 405 and response["Allow"] == ", ".join(allowed)
        assert f"use {' or '.join(allowed)}" in response.text
