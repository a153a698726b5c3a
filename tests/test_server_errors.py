"""Server errors leave a trace, and a deep JSON is no server error (issue 34, item 7;
docs/operating.md "Logs"). With DJANGO_DEBUG off, an unhandled exception in a view is logged with
its traceback through the redacting "console" handler (JSON when configured), and so is a
management command's crash; a decision or a step's result nested too deep, too large or not
storable is refused like an event on the API (recovery.jsoninput), with a message and nothing
changed."""

import json
import logging
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.http import HttpRequest, HttpResponse
from django.test import Client
from django.urls import path

from recovery import actions, jsoninput, validation
from recovery.errors import InvalidTransition
from recovery.logs import JsonFormatter
from recovery.management.commands import show_run
from recovery.models import AuditEvent, ModelDecision, WorkflowRun
from tests.support.console import act, failed_run, login

pytestmark = pytest.mark.django_db

SECRET = "sk-" + "A1b2C3d4E5f6G7h8I9j0K1L2"  # shaped like an OpenAI key: redacted wherever it appears
DEEP = "[" * 100_000


def boom(request: HttpRequest) -> HttpResponse:
    raise RuntimeError(f"the ledger said no to {SECRET}")


urlpatterns = [path("boom", boom)]


@pytest.fixture
def console_output():
    """What the configured "console" handler writes (for django.request, recovery, django.server:
    one handler), instead of stderr."""
    handler = next(h for h in logging.getLogger("django.request").handlers if h.get_name() == "console")
    stream = StringIO()
    previous = handler.setStream(stream)
    try:
        yield handler, stream
    finally:
        handler.setStream(previous)


@pytest.mark.urls(__name__)
def test_a_view_that_raises_without_debug_is_logged_with_its_traceback_redacted(settings, console_output):
    settings.DEBUG = False
    handler, stream = console_output
    response = Client(raise_request_exception=False).get("/boom")
    assert response.status_code == 500
    logged = stream.getvalue()
    assert "ERROR django.request Internal Server Error: /boom" in logged
    assert "Traceback (most recent call last)" in logged and "in boom" in logged
    assert "RuntimeError: the ledger said no to [REDACTED:openai_key]" in logged
    assert SECRET not in logged


@pytest.mark.urls(__name__)
def test_with_json_logs_the_500_is_one_json_object_with_its_redacted_traceback(settings, console_output):
    settings.DEBUG = False
    handler, stream = console_output
    formatter = handler.formatter
    handler.setFormatter(JsonFormatter())
    try:
        Client(raise_request_exception=False).get("/boom")
    finally:
        handler.setFormatter(formatter)
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert (record["level"], record["logger"], record["status_code"]) == ("ERROR", "django.request", 500)
    assert "RuntimeError: the ledger said no to [REDACTED:openai_key]" in record["exc_info"]
    assert SECRET not in line


def test_a_command_that_crashes_is_logged_redacted_and_ends_in_one_line(clock, monkeypatch, console_output):
    handler, stream = console_output
    run = failed_run(clock)
    monkeypatch.setattr(show_run, "run_document", lambda *a, **k: (_ for _ in ()).throw(RuntimeError(SECRET)))

    with pytest.raises(RuntimeError):  # called from code (a test, call_command): raised as it is
        call_command("show_run", run.workflow_id, stdout=StringIO())
    command = show_run.Command(stdout=StringIO(), stderr=StringIO())
    command._called_from_command_line = True  # as manage.py runs it
    with pytest.raises(CommandError) as ended:
        call_command(command, run.workflow_id)

    assert str(ended.value) == (
        "show_run crashed (RuntimeError); its traceback is logged above, redacted (--traceback to raise it)"
    )
    logged = stream.getvalue()
    assert logged.count("ERROR recovery.commands manage.py show_run crashed: RuntimeError") == 2
    assert "Traceback (most recent call last)" in logged and "RuntimeError: [REDACTED:openai_key]" in logged
    assert SECRET not in logged


def unchanged(run: WorkflowRun) -> tuple:
    run.refresh_from_db()
    return run.state, run.updated_at, AuditEvent.objects.count(), ModelDecision.objects.count()


@pytest.mark.parametrize(
    "decision,refusal",
    [
        (DEEP, "the decision is not valid JSON: nested too deeply"),
        ('{"a": ' * 40 + "1" + "}" * 40, "the decision is nested deeper than 32 levels (at a.a.a."),
        ('{"amount": NaN}', "the decision is not valid JSON: NaN is not JSON"),
        ('{"note": "' + "x" * (jsoninput.MAX_BYTES + 1) + '"}', "the decision is larger than 256 KiB"),
        ('{"note": "a\\u0000b"}', "the value at note contains a NUL character (U+0000)"),
    ],
)
def test_a_decision_beyond_the_events_bounds_is_400_with_a_message_and_changes_nothing(clock, decision, refusal):
    run = failed_run(clock)
    before = unchanged(run)
    response = act(login("supervisor"), run, "supersede", step="create_task", decision=decision)
    assert response.status_code == 400 and refusal in response.text
    assert unchanged(run) == before


def test_a_typed_result_and_the_recover_command_have_the_same_bounds():
    with pytest.raises(InvalidTransition, match="the result is not valid JSON: nested too deeply"):
        actions.parse_object(DEEP, "the result")
    login("supervisor")
    argv = ["supersede", "x", "--step", "s", "--decision", DEEP, "--reason", "r", "--as", "u-supervisor"]
    with pytest.raises(CommandError, match="the decision is not valid JSON: nested too deeply"):
        call_command("recover", *argv)


def test_start_workflow_refuses_an_event_nested_too_deep_in_one_line():
    with pytest.raises(CommandError, match="--input is not valid JSON: nested too deeply"):
        call_command("start_workflow", "test_orders", "--input", DEEP, stdout=StringIO())
    assert not WorkflowRun.objects.exists()


def test_a_model_output_nested_too_deep_still_gives_a_skeleton_to_write_a_decision_from():
    class Schema(validation.pydantic.BaseModel):
        amount: int

    assert validation.skeleton(Schema, DEEP) == validation.example_of(Schema)
