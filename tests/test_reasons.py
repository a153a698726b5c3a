"""Reasons and the terminal (issue 34, item 6; docs/security.md "Reasons and what the commands
print"). A four-eyes approval gives a reason under the same rules as every operator action
(required, at most 2,000 characters, no NUL); no reason may hold a control character but TAB and
a line break (ESC repaints the reader's terminal); and what the commands print of stored text
shows control characters as escapes, for rows stored before the check too."""

import re
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management import CommandError, call_command

from recovery.engine import transitions
from recovery.engine.transitions import _core
from recovery.errors import InvalidTransition
from recovery.models import ApprovalRequest, ApprovalState, AuditEvent, WorkflowRun
from recovery.text import printable
from tests.support.console import act, failed_run, login

pytestmark = pytest.mark.django_db

CLEAR_SCREEN = "\x1b[2J\x1b[Hall fine"  # erases the reader's screen, then says what it likes


def person(name: str, role: str):
    user = get_user_model().objects.create_user(name, password="pw")
    user.groups.add(Group.objects.get_or_create(name=role)[0])
    return user


def run_cmd(*args) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def recorded(run: WorkflowRun) -> tuple:
    run.refresh_from_db()
    return run.state, run.updated_at, AuditEvent.objects.count(), list(ApprovalRequest.objects.values("state"))


@pytest.mark.parametrize("char", ["\x1b", "\x07", "\x08", "\x7f", "\x9b", "\x85", "\x0b", "\x00"])
def test_a_reason_with_a_control_character_is_refused(char):
    with pytest.raises(InvalidTransition, match=r"(control|NUL) character \(U\+00"):
        transitions.require_reason(f"checked {char}with finance")


def test_a_reason_keeps_tabs_and_line_breaks_and_a_textareas_crlf_becomes_one_line_break():
    assert transitions.require_reason(" first line\r\nsecond\tline \r") == "first line\nsecond\tline"


def test_a_reason_with_esc_is_refused_in_the_console_and_the_command_and_nothing_is_recorded(clock):
    run = failed_run(clock)
    before = recorded(run)

    response = act(login("operator"), run, "retry", step="create_task", reason=CLEAR_SCREEN)
    assert response.status_code == 400 and "control character (U+001B)" in response.text

    person("olga", "operator")
    with pytest.raises(CommandError) as refused:
        run_cmd("recover", "retry", run.workflow_id, "--step", "create_task", "--reason", CLEAR_SCREEN, "--as", "olga")
    assert str(refused.value) == "the reason contains a control character (U+001B); write it as plain text"
    assert recorded(run) == before


@pytest.fixture
def supervisors():
    return person("alice", "supervisor"), person("bob", "supervisor")


def guarded_request(clock, alice, reason="customer cancelled") -> ApprovalRequest:
    run = failed_run(clock, "g-1", workflow="test_guarded")
    return transitions.approval_request(workflow_id=run.workflow_id, action="terminate", actor=alice, reason=reason)


@pytest.mark.parametrize(
    "reason,refusal",
    [
        ("", "a reason is required"),
        ("   ", "a reason is required"),
        ("x" * 100_000, "the reason is 100,000 characters long; at most 2,000 are allowed"),
        (CLEAR_SCREEN, "control character (U+001B)"),
    ],
)
def test_an_approval_needs_a_reason_like_every_action_and_a_bad_one_changes_nothing(
    clock, supervisors, reason, refusal
):
    alice, bob = supervisors
    request = guarded_request(clock, alice)
    before = recorded(request.run)
    with pytest.raises(InvalidTransition, match=re.escape(refusal)):
        transitions.approval_grant(request_id=request.pk, actor=bob, reason=reason)
    with pytest.raises(CommandError, match="reason"):
        run_cmd("approval", "approve", str(request.pk), "--reason", reason, "--as", "bob")
    assert recorded(request.run) == before
    request.refresh_from_db()
    assert (request.state, request.decided_by, request.decision_reason) == (ApprovalState.PENDING, None, "")


def test_the_console_approves_only_with_a_reason(clock, supervisors):
    alice, bob = supervisors
    request = guarded_request(clock, alice)
    client = login("supervisor")
    before = recorded(request.run)
    refused = act(client, request.run, "approve", request=str(request.pk), reason="")
    assert refused.status_code == 400 and "a reason is required" in refused.text
    assert recorded(request.run) == before

    page = client.get(f"/runs/{request.run.workflow_id}").text
    assert 'name="reason" required placeholder="reason" size="24" aria-label="reason to approve"' in page
    approved = act(client, request.run, "approve", request=str(request.pk), reason="the customer's letter is on file")
    assert approved.status_code == 200
    grant = AuditEvent.objects.get(action="approval_grant")
    assert grant.reason == "the customer's letter is on file"


def stored_as_before_the_check(monkeypatch):
    """Rows written by the code before this check: the reason's control characters pass."""
    monkeypatch.setattr(_core.text, "control_character", lambda text: None)


def test_show_run_and_approval_list_print_an_old_rows_escape_sequences_escaped(clock, supervisors, monkeypatch):
    alice, bob = supervisors
    stored_as_before_the_check(monkeypatch)
    request = guarded_request(clock, alice, reason=f"{CLEAR_SCREEN}\tand\na second line")
    monkeypatch.undo()
    assert "\x1b[2J" in request.reason and "\x1b[2J" in AuditEvent.objects.get(action="approval_request").reason

    shown = run_cmd("show_run", request.run.workflow_id)
    listed = run_cmd("approval", "list")

    for output in (shown, listed):
        assert "\x1b" not in output and "\\x1b[2J\\x1b[Hall fine" in output
    # show_run keeps a reason's line breaks (indented under its event); the list keeps one line a request
    assert "\\x1b[2J\\x1b[Hall fine\tand\n      a second line" in shown
    assert listed.count("\n") == 1 and listed.rstrip("\n").split("\t")[-1] == (
        "\\x1b[2J\\x1b[Hall fine\\tand\\na second line"
    )

    # and the old request can still be approved: the action runs with its words shown, not acted on
    transitions.approval_grant(request_id=request.pk, actor=bob, reason="checked")
    terminate = AuditEvent.objects.get(action="terminate")
    assert terminate.reason == "\\x1b[2J\\x1b[Hall fine\tand\na second line (requested by alice, approved by bob)"


def test_a_request_with_the_longest_reason_is_approved_with_its_reason_cut_to_fit(clock, supervisors):
    """The action runs with the request's reason and both names: 2,000 characters and the names
    would pass the bound, and the approval could never run."""
    alice, bob = supervisors
    request = guarded_request(clock, alice, reason="y" * 2000)
    transitions.approval_grant(request_id=request.pk, actor=bob, reason="checked")
    terminate = AuditEvent.objects.get(action="terminate")
    assert len(terminate.reason) == 2000 and terminate.reason.endswith("y… (requested by alice, approved by bob)")


def test_printable_shows_every_control_character_and_keeps_plain_text():
    assert printable("plain text, ünïcode, 😀\ttab") == "plain text, ünïcode, 😀\ttab"
    assert printable("a\x1b[31mb\x07\x08\x7f\x9b\r\n") == "a\\x1b[31mb\\x07\\x08\\x7f\\x9b\\r\\n"
    assert printable("one\ntwo\r", multiline=True) == "one\ntwo\\r"
    assert printable("\u202eevil") == "\\u202eevil"
    assert printable(None) == "None"


def test_a_command_error_quoting_stored_text_is_one_line_with_its_escapes(clock):
    run = failed_run(clock)
    with pytest.raises(CommandError) as refused:
        run_cmd("show_run", f"{run.workflow_id}\x1b[2J\nforged line")
    assert str(refused.value) == f"no run '{run.workflow_id}\\x1b[2J\\nforged line'"
