"""The simulated systems reproduce every unknown-outcome path (docs/operating.md: "real HTTP endpoints …
with scripted faults … so that the unknown-outcome path is real, not mocked"; the rules: a
timeout means "it may have happened", never "it did not"): a late commit (the receiver finishes
the request after the caller gave up), and faults on every operation, look-ups and compensations
included, armed through the ``sandbox fault`` command of docs/operating.md "Commands"."""

import os
import subprocess
import sys
import time
from datetime import datetime

import httpx
import pytest
from django.conf import settings
from django.core.management import CommandError
from django.test import Client
from django.utils import timezone

from sandbox import faults, services
from sandbox.models import FAULTABLE, Fault, FaultMode, LedgerEntry, Message, Task
from tests.support.sandbox_api import ENTRY, TASK, adapter_client, create_task, post, post_entry, run_sandbox, send

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])

CLIENT_TIMEOUT = 0.3  # seconds the caller waits for an answer
LATE_MS = 1500  # how long a late_commit fault holds the request: well past CLIENT_TIMEOUT
SETTLE_SECONDS = 60  # how long a test waits for a late write to land on a busy machine

LOOKUPS = {
    "tasks": ("/sandbox/tasks/", {"idempotency_key": "key-1"}),
    "messages": ("/sandbox/messages/", {"client_ref": "ref-1"}),
    "ledger": ("/sandbox/ledger/entries/", {"reference": ENTRY["reference"]}),
}


@pytest.fixture
def api() -> Client:
    """A caller with the sandbox's API key, in-process (Django's test client)."""
    return adapter_client()


@pytest.fixture
def sandbox_url(live_server, settings) -> str:
    """The simulated systems served over real HTTP by a live server, as the adapters reach them."""
    settings.SANDBOX_URL = live_server.url
    return live_server.url


def http_post(url: str, body: dict, **headers) -> httpx.Response:
    """POST as an adapter does (with the sandbox's key), giving up after CLIENT_TIMEOUT."""
    auth = {"Authorization": f"Bearer {settings.SANDBOX_API_KEY}"}
    return httpx.post(url, json=body, headers={**auth, **headers}, timeout=CLIENT_TIMEOUT)


def wait_for(query) -> None:
    """Poll ``query`` (a queryset) until something is there, for up to SETTLE_SECONDS."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while not query.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def seed(api) -> dict:
    """One object in each service, found by the look-ups in LOOKUPS."""
    task = create_task(api).json()
    message = send(api).json()
    entry = post_entry(api).json()
    return {"task": task, "message": message, "entry": entry}


# --- late_commit -----------------------------------------------------------------------


def late_request(api, operation: str) -> tuple[str, dict, dict, object]:
    """The path, body and headers of one write, and the query for the row it writes."""
    if operation == "tasks create":
        written = Task.objects.filter(idempotency_key="late-key")
        return "/sandbox/tasks/", TASK, {"Idempotency-Key": "late-key"}, written
    if operation == "messages send":
        written = Message.objects.filter(client_ref="late", kind="message")
        return "/sandbox/messages/", {"to": "bob", "text": "hi", "client_ref": "late"}, {}, written
    if operation == "ledger post":
        written = LedgerEntry.objects.filter(reference="late", kind="entry")
        return "/sandbox/ledger/entries/", {**ENTRY, "reference": "late"}, {}, written
    if operation == "messages correct":
        original = send(api).json()["id"]
        written = Message.objects.filter(client_ref="late", kind="correction")
        return f"/sandbox/messages/{original}/corrections", {"text": "fix", "client_ref": "late"}, {}, written
    entry = post_entry(api).json()["id"]  # ledger reverse
    written = LedgerEntry.objects.filter(reference="late", kind="reversal")
    return f"/sandbox/ledger/entries/{entry}/reverse", {"reference": "late"}, {}, written


def late_write(api, base: str, operation: str):
    """Arm late_commit on ``operation``, send it over HTTP and give up after CLIENT_TIMEOUT.
    Returns the moment the caller gave up (taken after its timeout fired, so no earlier than the
    real moment) and the query for what the request writes."""
    path, body, headers, written = late_request(api, operation)
    service, _, name = operation.partition(" ")
    faults.set_fault(service, name, "late_commit", delay_ms=LATE_MS)
    with pytest.raises(httpx.ReadTimeout):
        http_post(f"{base}{path}", body, **headers)
    gave_up: datetime = timezone.now()
    return gave_up, written


@pytest.mark.parametrize(
    "operation", ["tasks create", "messages send", "ledger post", "messages correct", "ledger reverse"]
)
def test_late_commit_writes_only_after_the_caller_gave_up(api, sandbox_url, operation):
    """the rules: a timeout is an unknown outcome, and the commonest one is a late commit; the
    sandbox reproduces it for real: the row's creation time is after the caller's timeout."""
    gave_up, written = late_write(api, sandbox_url, operation)
    wait_for(written)
    assert written.count() == 1
    assert written.get().created_at > gave_up


def test_a_late_committed_task_is_found_by_its_key_and_a_retry_with_that_key_replays_it(api, sandbox_url):
    """the rules: a stable idempotency key makes the retry after an unknown outcome safe: after a
    late commit, the look-up finds the one task and the same request replays it."""
    _, written = late_write(api, sandbox_url, "tasks create")
    wait_for(written)
    found = api.get("/sandbox/tasks/", {"idempotency_key": "late-key"}).json()["results"]
    retried = create_task(api, key="late-key")
    assert [t["id"] for t in found] == [retried.json()["id"]] == [written.get().public_id]
    assert retried.headers["Idempotent-Replayed"] == "true"
    assert Task.objects.count() == 1


def test_late_commit_waits_before_it_performs_and_commit_then_drop_after(api, monkeypatch):
    """docs/operating.md: commit_then_drop commits at once and loses the answer; late_commit commits only
    once its wait is over (what is written when the wait begins tells them apart)."""
    seen_when_waiting: list = []
    monkeypatch.setattr(services.time, "sleep", lambda seconds: seen_when_waiting.append(Message.objects.count()))
    faults.set_fault("messages", "send", "late_commit", delay_ms=50)
    faults.set_fault("messages", "send", "commit_then_drop", delay_ms=50)
    assert send(api).status_code == 201  # late_commit: waited with nothing written, then wrote
    assert send(api).status_code == 201  # commit_then_drop: wrote, then waited
    assert seen_when_waiting == [0, 2]


def test_late_commit_waits_one_second_past_the_read_timeout_by_default(api, monkeypatch, settings):
    """docs/operating.md: by default a late commit lands after the adapters' read timeout."""
    settings.RECOVERY_HTTP_TIMEOUT = 1.0
    waited: list = []
    monkeypatch.setattr(services.time, "sleep", waited.append)
    faults.set_fault("ledger", "post", "late_commit")
    assert post_entry(api).status_code == 201
    assert waited == [2.0]


# --- Faults on look-ups ----------------------------------------------------------------


@pytest.mark.parametrize("service", list(LOOKUPS))
@pytest.mark.parametrize(
    "mode,status", [("unavailable", 503), ("fail_before_commit", 500), ("forbidden", 403), ("rate_limit", 429)]
)
def test_a_refused_lookup_answers_its_status_changes_nothing_and_the_next_one_answers(api, service, mode, status):
    """the rules: a look-up that fails proves nothing either way; the refusing modes never run it
    and write nothing, and the fault hits exactly the calls it was armed for."""
    seed(api)
    path, query = LOOKUPS[service]
    expected = api.get(path, query).json()
    before = faults.counts()
    faults.set_fault(service, "find", mode, retry_after=4)
    response = api.get(path, query)
    assert response.status_code == status and response.json()["error"]
    assert (response.headers.get("Retry-After") == "4") == (mode == "rate_limit")
    assert faults.counts() == before
    assert api.get(path, query).json() == expected
    assert Fault.objects.get().remaining == 0


@pytest.mark.parametrize("service", list(LOOKUPS))
def test_a_slow_lookup_answers_late_and_correctly(api, service):
    """docs/operating.md (slow): the look-up waits, then answers what is there."""
    seed(api)
    path, query = LOOKUPS[service]
    expected = api.get(path, query).json()
    assert len(expected["results"]) == 1
    faults.set_fault(service, "find", "slow", delay_ms=100)
    started = time.monotonic()
    response = api.get(path, query)
    assert time.monotonic() - started >= 0.1
    assert response.status_code == 200 and response.json() == expected


@pytest.mark.parametrize("mode", ["commit_then_drop", "late_commit"])
def test_a_dropped_lookup_answers_after_the_caller_gave_up_and_the_next_one_answers(api, sandbox_url, mode):
    """the rules: a reconciling look-up can itself time out (an unknown, not an empty answer);
    commit_then_drop and late_commit on a read hold the answer past the caller's timeout."""
    task = create_task(api).json()
    faults.set_fault("tasks", "find", mode, delay_ms=LATE_MS)
    url, query = f"{sandbox_url}/sandbox/tasks/", {"idempotency_key": "key-1"}
    auth = {"Authorization": f"Bearer {settings.SANDBOX_API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.get(url, params=query, headers=auth, timeout=CLIENT_TIMEOUT)
    answer = httpx.get(url, params=query, headers=auth, timeout=SETTLE_SECONDS)
    assert answer.status_code == 200 and answer.json() == {"results": [task]}
    assert Task.objects.count() == 1


# --- Faults on compensations -----------------------------------------------------------


def test_a_correction_that_fails_before_commit_writes_nothing_and_the_next_one_works(api):
    """the rules: a compensation is a side effect like any other; a refused one changed nothing."""
    original = send(api).json()
    faults.set_fault("messages", "correct", "fail_before_commit")
    url = f"/sandbox/messages/{original['id']}/corrections"
    refused = post(api, url, {"text": "sorry: inv-1848", "client_ref": "fix-1"})
    assert refused.status_code == 500 and refused.json()["error"]
    assert faults.counts()["corrections"] == 0 and Message.objects.count() == 1
    response = post(api, url, {"text": "sorry: inv-1848", "client_ref": "fix-1"})
    assert response.status_code == 201 and response.json()["corrects"] == original["id"]
    assert faults.counts()["corrections"] == 1


def test_a_reversal_that_fails_before_commit_writes_nothing_and_the_next_one_works(api):
    """the rules: a refused reversal neither reverses the entry nor takes its reference."""
    entry = post_entry(api).json()
    faults.set_fault("ledger", "reverse", "fail_before_commit")
    url = f"/sandbox/ledger/entries/{entry['id']}/reverse"
    refused = post(api, url, {"reference": "rev-1"})
    assert refused.status_code == 500 and refused.json()["error"]
    assert faults.counts()["ledger_reversals"] == 0 and LedgerEntry.objects.count() == 1
    response = post(api, url, {"reference": "rev-1"})
    assert response.status_code == 201 and response.json()["reverses"] == entry["id"]
    assert faults.counts()["ledger_reversals"] == 1


@pytest.mark.parametrize(
    "service,operation,path",
    [
        ("tasks", "cancel", "/sandbox/tasks/task_1/cancel"),
        ("messages", "correct", "/sandbox/messages/msg_1/corrections"),
    ],
)
def test_a_malformed_request_is_a_400_and_consumes_no_fault(api, service, operation, path):
    """docs/operating.md "Commands": bad input is refused before anything else happens, an armed fault included."""
    faults.set_fault(service, operation, "unavailable")
    assert post(api, path, {}).status_code == 400
    assert Fault.objects.get().remaining == 1


# --- Arming them -----------------------------------------------------------------------


def test_every_operation_of_every_service_is_faultable_with_every_mode():
    """docs/operating.md "Commands": `sandbox fault SERVICE OPERATION MODE` names create|cancel|find|get,
    send|find|get|correct, post|find|get|reverse; the mode and operation columns hold every name."""
    assert {s: list(ops) for s, ops in FAULTABLE.items()} == {
        "tasks": ["create", "cancel", "find", "get"],
        "messages": ["send", "find", "get", "correct"],
        "ledger": ["post", "find", "get", "reverse"],
    }
    assert "late_commit" in FaultMode.values
    assert max(len(m) for m in FaultMode.values) <= Fault._meta.get_field("mode").max_length
    for service, operations in FAULTABLE.items():
        assert max(len(o) for o in operations) <= Fault._meta.get_field("operation").max_length
        for operation in operations:
            for mode in FaultMode.values:
                faults.set_fault(service, operation, mode)
    assert Fault.objects.count() == sum(len(ops) for ops in FAULTABLE.values()) * len(FaultMode.values)


def test_the_command_arms_late_commit_on_a_compensation_and_says_when_it_lands():
    """docs/operating.md "Commands": `sandbox fault ledger reverse late_commit` arms one call, said in one line."""
    line = run_sandbox("fault", "ledger", "reverse", "late_commit")
    assert line == "armed: ledger reverse late_commit for the next 1 call(s), delay: read timeout + 1 s"
    line = run_sandbox("fault", "tasks", "find", "late_commit", "--delay-ms", "1500", "--times", "2")
    assert line == "armed: tasks find late_commit for the next 2 call(s), delay 1500 ms"
    assert Fault.objects.filter(mode="late_commit").count() == 2


def test_the_command_refuses_an_operation_the_service_lacks_naming_the_ones_it_has():
    """docs/operating.md "Commands": bad arguments are one line, exit ≠ 0, nothing written."""
    with pytest.raises(CommandError) as info:
        run_sandbox("fault", "ledger", "correct", "late_commit")
    assert str(info.value) == "unknown operation 'correct' for ledger (expected one of: post, find, get, reverse)"
    assert Fault.objects.count() == 0


def test_the_command_refuses_an_unknown_operation_with_one_line_on_stderr_from_the_shell(settings):
    """docs/operating.md "Commands": from the shell, a bad operation is one line on stderr and a non-zero exit."""
    result = subprocess.run(
        [sys.executable, str(settings.BASE_DIR / "manage.py"), "sandbox", "fault", "messages", "cancel", "late_commit"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "config.test_settings"},
    )
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.strip().count("\n") == 0
    assert "unknown operation 'cancel' for messages (expected one of: send, find, get, correct)" in result.stderr
