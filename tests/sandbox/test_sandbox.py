"""The simulated external systems (docs/operating.md): a task tracker that honours Idempotency-Key, a
messenger that never dedupes, a ledger with unique references and reversals, and scripted
faults stored in their own database."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from django.core.management import CommandError
from django.db import connections, router

from sandbox import faults, services
from sandbox.models import Fault, LedgerEntry, Message, Task
from sandbox.services import past_timeout_seconds
from tests.support.sandbox_api import ENTRY, TASK, adapter_client, create_task, post, post_entry, run_sandbox, send

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])


# --- Tasks -----------------------------------------------------------------------------


def test_creating_a_task_returns_201_with_the_documented_shape(api):
    response = create_task(api)
    assert response.status_code == 201
    body = response.json()
    assert set(body) == {
        "id",
        "title",
        "assignee",
        "payload",
        "status",
        "cancel_reason",
        "idempotency_key",
        "created_at",
        "decision",
        "decided_by",
        "callback_url",
        "callback_status",
    }
    assert body["id"].startswith("task_")
    assert body["status"] == "open" and body["cancel_reason"] == "" and body["idempotency_key"] == "key-1"
    assert body["payload"] == TASK["payload"]
    assert "Idempotent-Replayed" not in response.headers


def test_the_same_key_and_body_replay_the_first_response_and_create_nothing(api):
    first = create_task(api)
    again = create_task(api, body=json.loads(json.dumps(TASK)))
    assert again.status_code == first.status_code == 201
    assert again.json() == first.json()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert Task.objects.count() == 1


def test_the_same_key_with_a_different_body_is_a_422_and_creates_nothing(api):
    create_task(api)
    response = create_task(api, body={**TASK, "assignee": "bob"})
    assert response.status_code == 422
    assert response.json() == {"error": "idempotency key reused with a different payload"}
    assert Task.objects.get().assignee == "alice"


def test_a_task_post_without_an_idempotency_key_is_a_400(api):
    response = post(api, "/sandbox/tasks/", TASK)
    assert response.status_code == 400 and "Idempotency-Key" in response.json()["error"]
    assert Task.objects.count() == 0


@pytest.mark.parametrize(
    "raw", ["{not json", "[1, 2]", json.dumps({"title": "t"}), json.dumps({**TASK, "payload": [1]})]
)
def test_bad_json_or_missing_fields_are_a_400_with_an_error(api, raw):
    response = api.post("/sandbox/tasks/", data=raw, content_type="application/json", headers={"Idempotency-Key": "k"})
    assert response.status_code == 400 and response.json()["error"]
    assert Task.objects.count() == 0


def test_tasks_are_found_by_idempotency_key_and_an_unknown_key_finds_none(api):
    created = create_task(api).json()
    create_task(api, key="key-2")
    assert api.get("/sandbox/tasks/", {"idempotency_key": "key-1"}).json() == {"results": [created]}
    assert api.get("/sandbox/tasks/", {"idempotency_key": "nope"}).json() == {"results": []}


def test_open_tasks_are_searched_by_their_payloads_tenant_amount_and_currency_as_sums(api):
    def task(key, status="open", **payload):
        body = {"title": key, "assignee": "alice", "payload": {"tenant": "acme", "currency": "EUR", **payload}}
        created = create_task(api, key=key, body=body).json()
        if status == "cancelled":
            post(api, f"/sandbox/tasks/{created['id']}/cancel", {"reason": "withdrawn"})
        return created["id"]

    as_string, as_number = task("string", amount="1840.00"), task("number", amount=1840)
    task("cancelled", status="cancelled", amount="1840.00")
    task("other-tenant", amount="1840.00", tenant="globex")
    task("other-currency", amount="1840.00", currency="USD")
    task("other-amount", amount="1840.01")
    task("no-amount")

    found = api.get("/sandbox/tasks/", {"tenant": "acme", "amount": "1840", "currency": "EUR"})
    assert found.status_code == 200
    assert [t["id"] for t in found.json()["results"]] == [as_string, as_number]
    assert len(api.get("/sandbox/tasks/", {"tenant": "acme"}).json()["results"]) == 5  # every open one of acme
    assert api.get("/sandbox/tasks/", {"tenant": "initech"}).json() == {"results": []}
    # A look-up by key still finds a cancelled task: reconciling must see it.
    assert api.get("/sandbox/tasks/", {"idempotency_key": "cancelled"}).json()["results"][0]["status"] == "cancelled"


@pytest.mark.parametrize(
    "query,message",
    [
        ({"amount": "lots"}, "'amount' must be a decimal string"),
        ({"amount": "1.234"}, "at most 2 decimal places"),
        ({"currency": "euro"}, "'currency' must be a three-letter code"),
        ({"tenant": ""}, "'tenant' must be a non-empty string"),
    ],
)
def test_a_malformed_search_is_a_400_before_any_fault_is_consumed(api, query, message):
    faults.set_fault("tasks", "find", "unavailable")
    response = api.get("/sandbox/tasks/", query)
    assert response.status_code == 400 and message in response.json()["error"]
    assert Fault.objects.get().remaining == 1


def test_a_fault_on_find_breaks_the_search_as_it_breaks_the_look_up_by_key(api):
    run_sandbox("fault", "tasks", "find", "unavailable", "--times", "2")
    query = {"tenant": "acme", "amount": "1840.00", "currency": "EUR"}
    assert api.get("/sandbox/tasks/", query).status_code == 503
    assert api.get("/sandbox/tasks/", {"idempotency_key": "k"}).status_code == 503
    assert api.get("/sandbox/tasks/", query).json() == {"results": []}


def test_cancelling_is_idempotent_and_keeps_the_first_reason(api):
    task_id = create_task(api).json()["id"]
    first = post(api, f"/sandbox/tasks/{task_id}/cancel", {"reason": "duplicate invoice"})
    second = post(api, f"/sandbox/tasks/{task_id}/cancel", {"reason": "changed my mind"})
    assert first.status_code == second.status_code == 200
    assert second.json()["status"] == "cancelled"
    assert second.json()["cancel_reason"] == "duplicate invoice"
    assert faults.counts()["tasks_cancelled"] == 1


def test_finished_tasks_are_done_out_of_the_open_search_found_by_key_counted_as_before_and_still_cancellable(api):
    """The demo's reset (sandbox.faults.finish_tasks): the approvers work through the open tasks of
    the invoices named, by tenant and invoice id; a done task is neither open nor cancelled."""

    def task(key, tenant, invoice_id, amount="1840.00"):
        payload = {"tenant": tenant, "invoice_id": invoice_id, "amount": amount, "currency": "EUR"}
        return create_task(api, key=key, body={"title": key, "assignee": "alice", "payload": payload}).json()["id"]

    finished, other_invoice = task("a", "acme", "INV-1"), task("b", "acme", "INV-2")
    task("c", "hooli", "INV-1")  # the same invoice id at another tenant
    withdrawn = task("d", "acme", "INV-3", amount="99.00")
    post(api, f"/sandbox/tasks/{withdrawn}/cancel", {"reason": "withdrawn"})
    counted = faults.counts()

    assert faults.finish_tasks([("acme", "INV-1"), ("acme", "INV-3"), ("wayne", "INV-2")]) == 1
    assert dict(Task.objects.values_list("idempotency_key", "status")) == {
        "a": "done",
        "b": "open",
        "c": "open",
        "d": "cancelled",  # a cancelled task stays cancelled, with its reason
    }
    assert faults.counts() == counted
    search = api.get("/sandbox/tasks/", {"tenant": "acme", "amount": "1840.00", "currency": "EUR"}).json()
    assert [t["id"] for t in search["results"]] == [other_invoice]
    assert api.get("/sandbox/tasks/", {"idempotency_key": "a"}).json()["results"][0]["status"] == "done"
    assert faults.finish_tasks([("acme", "INV-1")]) == 0  # done already
    cancelled = post(api, f"/sandbox/tasks/{finished}/cancel", {"reason": "compensated"}).json()
    assert (cancelled["status"], cancelled["cancel_reason"]) == ("cancelled", "compensated")
    assert faults.counts() == {**counted, "tasks_cancelled": counted["tasks_cancelled"] + 1}


@pytest.mark.parametrize("task_id", ["task_999999", "msg_1", "garbage"])
def test_cancelling_an_unknown_task_is_a_404(api, task_id):
    response = post(api, f"/sandbox/tasks/{task_id}/cancel", {"reason": "x"})
    assert response.status_code == 404 and response.json()["error"]


def test_two_concurrent_posts_with_one_key_create_one_task():
    n = 6
    barrier = threading.Barrier(n)
    responses: list = []

    def worker():
        try:
            barrier.wait()
            responses.append(create_task(adapter_client()))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [r.status_code for r in responses] == [201] * n
    assert sorted(r.headers.get("Idempotent-Replayed", "") for r in responses) == [""] + ["true"] * (n - 1)
    assert len({r.json()["id"] for r in responses}) == 1
    assert Task.objects.count() == 1


# --- Messages --------------------------------------------------------------------------


def test_every_send_is_a_new_message_even_with_the_same_idempotency_key(api):
    first = send(api, **{"Idempotency-Key": "same"})
    second = send(api, **{"Idempotency-Key": "same"})
    assert first.status_code == second.status_code == 201
    assert first.json()["id"] != second.json()["id"]
    assert set(first.json()) == {"id", "to", "text", "client_ref", "kind", "corrects", "created_at"}
    assert first.json()["kind"] == "message" and first.json()["corrects"] is None
    assert faults.counts()["messages"] == 2


def test_messages_are_found_by_client_ref_in_creation_order(api):
    a = send(api, text="one").json()
    send(api, text="other", client_ref="ref-2")
    b = send(api, text="two").json()
    assert api.get("/sandbox/messages/", {"client_ref": "ref-1"}).json() == {"results": [a, b]}
    assert api.get("/sandbox/messages/", {"client_ref": "none"}).json() == {"results": []}


def test_a_correction_is_a_new_message_counted_separately(api):
    original = send(api).json()
    response = post(api, f"/sandbox/messages/{original['id']}/corrections", {"text": "sorry: inv-1848"})
    assert response.status_code == 201
    correction = response.json()
    assert correction["kind"] == "correction" and correction["corrects"] == original["id"]
    assert correction["to"] == original["to"]
    assert Message.objects.get(pk=int(original["id"].removeprefix("msg_"))).text == original["text"]
    counts = faults.counts()
    assert (counts["messages"], counts["corrections"]) == (1, 1)


def test_correcting_an_unknown_message_is_a_404(api):
    response = post(api, "/sandbox/messages/msg_999999/corrections", {"text": "x"})
    assert response.status_code == 404
    assert Message.objects.count() == 0


# --- Ledger ----------------------------------------------------------------------------


def test_posting_an_entry_returns_201_with_the_documented_shape(api):
    response = post_entry(api)
    assert response.status_code == 201
    body = response.json()
    assert body["id"].startswith("le_")
    assert {k: body[k] for k in ENTRY} == ENTRY
    assert body["kind"] == "entry" and body["reverses"] is None and body["created_at"]


def test_a_duplicate_reference_is_a_409_naming_the_existing_entry_and_writes_nothing(api):
    first = post_entry(api).json()
    response = post_entry(api, amount="999.00")
    assert response.status_code == 409
    assert response.json() == {"error": "duplicate reference", "existing_id": first["id"]}
    assert LedgerEntry.objects.count() == 1


@pytest.mark.parametrize("amount", ["12.345", "abc", 12.5, "NaN", ""])
def test_an_amount_that_is_not_a_two_place_decimal_string_is_a_400(api, amount):
    assert post_entry(api, amount=amount).status_code == 400
    assert LedgerEntry.objects.count() == 0


def test_entries_are_found_by_reference(api):
    entry = post_entry(api).json()
    post_entry(api, reference="other")
    assert api.get("/sandbox/ledger/entries/", {"reference": ENTRY["reference"]}).json() == {"results": [entry]}


def test_reversing_negates_the_amount_once_and_never_deletes(api):
    entry = post_entry(api).json()
    response = post(api, f"/sandbox/ledger/entries/{entry['id']}/reverse", {"reference": "rev-1", "memo": "oops"})
    assert response.status_code == 201
    reversal = response.json()
    assert reversal["kind"] == "reversal" and reversal["reverses"] == entry["id"]
    assert reversal["amount"] == "-123.45"
    assert (reversal["currency"], reversal["account"]) == (entry["currency"], entry["account"])

    again = post(api, f"/sandbox/ledger/entries/{entry['id']}/reverse", {"reference": "rev-2"})
    assert again.status_code == 409
    assert again.json() == {"error": "already reversed", "existing_id": reversal["id"]}

    assert entry["reversed_by"] is None
    # The entry itself is unchanged; it now says which entry reversed it.
    listed = api.get("/sandbox/ledger/entries/", {"reference": ENTRY["reference"]}).json()
    assert listed == {"results": [{**entry, "reversed_by": reversal["id"]}]}
    counts = faults.counts()
    assert (counts["ledger_entries"], counts["ledger_reversals"]) == (1, 1)


def test_a_reversal_with_a_taken_reference_is_a_409_and_a_reversal_cannot_be_reversed(api):
    entry = post_entry(api).json()
    other = post_entry(api, reference="other").json()
    taken = post(api, f"/sandbox/ledger/entries/{entry['id']}/reverse", {"reference": "other"})
    assert taken.status_code == 409
    assert taken.json() == {"error": "duplicate reference", "existing_id": other["id"]}

    reversal = post(api, f"/sandbox/ledger/entries/{entry['id']}/reverse", {"reference": "rev-1"}).json()
    response = post(api, f"/sandbox/ledger/entries/{reversal['id']}/reverse", {"reference": "rev-2"})
    assert response.status_code == 400
    assert post(api, "/sandbox/ledger/entries/le_999999/reverse", {"reference": "rev-3"}).status_code == 404
    assert LedgerEntry.objects.count() == 3


# --- Faults ----------------------------------------------------------------------------


def test_fail_before_commit_answers_500_and_writes_nothing(api):
    faults.set_fault("tasks", "create", "fail_before_commit")
    response = create_task(api)
    assert response.status_code == 500 and response.json()["error"]
    assert Task.objects.count() == 0
    assert create_task(api).status_code == 201  # the key was not consumed either
    assert Task.objects.count() == 1


def test_commit_then_drop_commits_before_it_answers_late(api, monkeypatch):
    seen_while_waiting: list = []
    real_sleep = time.sleep

    def sleep(seconds):
        seen_while_waiting.append((seconds, Message.objects.count()))
        real_sleep(seconds)

    monkeypatch.setattr(services.time, "sleep", sleep)
    faults.set_fault("messages", "send", "commit_then_drop", delay_ms=50)
    response = send(api)
    assert response.status_code == 201 and response.json()["kind"] == "message"
    assert seen_while_waiting == [(0.05, 1)]  # committed (visible) before the wait began


def test_commit_then_drop_and_late_commit_wait_past_the_read_timeout_by_default(settings):
    settings.RECOVERY_HTTP_TIMEOUT = 1.0
    assert past_timeout_seconds(0) == 2.0
    assert past_timeout_seconds(250) == 0.25


def test_rate_limit_answers_429_with_retry_after_and_writes_nothing(api):
    faults.set_fault("ledger", "post", "rate_limit", retry_after=7)
    response = post_entry(api)
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "7"
    assert LedgerEntry.objects.count() == 0


@pytest.mark.parametrize("mode,status", [("forbidden", 403), ("unavailable", 503)])
def test_forbidden_and_unavailable_refuse_and_write_nothing(api, mode, status):
    faults.set_fault("messages", "send", mode)
    response = send(api)
    assert response.status_code == status and response.json()["error"]
    assert Message.objects.count() == 0


def test_slow_waits_then_proceeds_normally(api):
    faults.set_fault("tasks", "create", "slow", delay_ms=100)
    started = time.monotonic()
    response = create_task(api)
    assert time.monotonic() - started >= 0.1
    assert response.status_code == 201 and Task.objects.count() == 1


def test_a_fault_on_cancel_leaves_the_task_open(api):
    task_id = create_task(api).json()["id"]
    faults.set_fault("tasks", "cancel", "unavailable")
    assert post(api, f"/sandbox/tasks/{task_id}/cancel", {"reason": "x"}).status_code == 503
    assert Task.objects.get().status == "open"


def test_a_fault_hits_exactly_times_calls_then_behaviour_is_normal(api):
    faults.set_fault("messages", "send", "unavailable", times=2)
    statuses = [send(api).status_code for _ in range(4)]
    assert statuses == [503, 503, 201, 201]
    assert Fault.objects.get().remaining == 0


def test_faults_for_one_operation_are_consumed_oldest_first_and_leave_others_alone(api):
    faults.set_fault("messages", "send", "forbidden")
    faults.set_fault("messages", "send", "unavailable")
    assert create_task(api).status_code == 201
    assert post_entry(api).status_code == 201
    assert [send(api).status_code for _ in range(3)] == [403, 503, 201]


def test_a_fault_armed_on_a_write_leaves_lookups_corrections_and_reversals_alone(api):
    message = send(api).json()
    entry = post_entry(api).json()
    for service, operation in [("messages", "send"), ("ledger", "post"), ("tasks", "create")]:
        faults.set_fault(service, operation, "unavailable")
    assert api.get("/sandbox/messages/", {"client_ref": "ref-1"}).status_code == 200
    assert api.get("/sandbox/tasks/").status_code == 200
    assert post(api, f"/sandbox/messages/{message['id']}/corrections", {"text": "fix"}).status_code == 201
    assert post(api, f"/sandbox/ledger/entries/{entry['id']}/reverse", {"reference": "rev"}).status_code == 201
    assert all(f.remaining == 1 for f in Fault.objects.all())


def test_concurrent_callers_consume_each_unit_of_a_fault_exactly_once():
    faults.set_fault("ledger", "post", "unavailable", times=3)
    n = 8
    barrier = threading.Barrier(n)
    taken: list = []

    def worker():
        try:
            barrier.wait()
            taken.append(faults.consume_fault("ledger", "post") is not None)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(taken) == n and sum(taken) == 3
    assert Fault.objects.get().remaining == 0


@pytest.mark.parametrize(
    "args,kwargs,message",
    [
        (("jira", "create", "slow"), {}, "unknown service 'jira'"),
        (("ledger", "create", "slow"), {}, "unknown operation 'create' for ledger"),
        (
            ("messages", "reverse", "late_commit"),
            {},
            r"unknown operation 'reverse' for messages \(expected one of: send, find, get, correct\)",
        ),
        (("tasks", "create", "explode"), {}, "unknown mode 'explode'"),
        (("tasks", "create", "slow"), {"times": 0}, "times must be"),
        (("tasks", "create", "rate_limit"), {"retry_after": -1}, "retry_after must be"),
    ],
)
def test_set_fault_rejects_bad_combinations_with_a_clear_value_error(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        faults.set_fault(*args, **kwargs)
    assert Fault.objects.count() == 0


def test_counts_has_the_documented_keys_and_clear_leaves_a_clean_slate(api):
    assert faults.counts() == dict.fromkeys(
        ["tasks", "tasks_cancelled", "messages", "corrections", "ledger_entries", "ledger_reversals"], 0
    )
    task_id = create_task(api).json()["id"]
    post(api, f"/sandbox/tasks/{task_id}/cancel", {"reason": "x"})
    message = send(api).json()
    post(api, f"/sandbox/messages/{message['id']}/corrections", {"text": "fix"})
    entry = post_entry(api).json()
    post(api, f"/sandbox/ledger/entries/{entry['id']}/reverse", {"reference": "rev"})
    faults.set_fault("tasks", "create", "slow")
    assert faults.counts() == dict.fromkeys(faults.counts(), 1)

    faults.clear()
    assert set(faults.counts().values()) == {0} and Fault.objects.count() == 0
    assert create_task(api).status_code == 201  # the idempotency records went too: the key is fresh


# --- The command -----------------------------------------------------------------------


def test_the_command_arms_a_fault_counts_and_clears(api):
    line = run_sandbox("fault", "tasks", "create", "rate_limit", "--times", "2", "--retry-after", "3")
    assert len(line.splitlines()) == 1 and "tasks create rate_limit" in line
    fault = Fault.objects.get()
    assert (fault.remaining, fault.retry_after) == (2, 3)
    assert create_task(api).headers["Retry-After"] == "3"

    run_sandbox("fault", "messages", "send", "slow", delay_ms=10)
    assert Fault.objects.filter(mode="slow", delay_ms=10).exists()
    send(api)
    assert json.loads(run_sandbox("counts", "--json")) == {**dict.fromkeys(faults.counts(), 0), "messages": 1}
    assert "messages=1" in run_sandbox("counts")

    assert len(run_sandbox("clear").splitlines()) == 1
    assert Fault.objects.count() == 0 and Message.objects.count() == 0


def test_counts_of_one_run_are_what_carries_its_keys_duplicates_included():
    """`sandbox counts --run ID` (the README's walk-through reads it after every experiment):
    the objects carrying the run's step or compensation keys, and the ledger entries referenced
    by its workflow id; another run's objects are not counted, a duplicate message is."""
    from recovery.engine.transitions import run_start
    from recovery.workflow import compensation_key, idempotency_key

    mine, _ = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "o-1", "text": "chairs 10"})
    other, _ = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "o-10", "text": "chairs 10"})
    for run in (mine, other):
        wid = run.workflow_id
        Task.objects.create(title="t", assignee="a", idempotency_key=idempotency_key(wid, "create_task", 1))
        Message.objects.create(to="a", text="m", client_ref=idempotency_key(wid, "notify", 1))
        LedgerEntry.objects.create(reference=wid, amount=10, currency="EUR", account="x")  # o-1 is no prefix of o-10
    Message.objects.create(to="a", text="m", client_ref=idempotency_key(mine.workflow_id, "notify", 1))  # twice
    Message.objects.create(
        to="a", text="fix", client_ref=compensation_key(mine.workflow_id, "notify", 1), kind="correction"
    )
    Task.objects.filter(idempotency_key=idempotency_key(mine.workflow_id, "create_task", 1)).update(status="cancelled")
    LedgerEntry.objects.create(
        reference=f"{mine.workflow_id}:reversal", amount=-10, currency="EUR", account="x", kind="reversal"
    )

    assert json.loads(run_sandbox("counts", "--run", mine.workflow_id, "--json")) == {
        "tasks": 1,
        "tasks_cancelled": 1,
        "messages": 2,
        "corrections": 1,
        "ledger_entries": 1,
        "ledger_reversals": 1,
    }
    assert run_sandbox("counts", "--run", other.workflow_id).split() == [
        "tasks=1",
        "tasks_cancelled=0",
        "messages=1",
        "corrections=0",
        "ledger_entries=1",
        "ledger_reversals=0",
    ]
    assert faults.counts()["messages"] == 3


def test_counts_of_a_run_that_does_not_exist_is_an_error():
    with pytest.raises(CommandError, match="no run 'order:t:nope'"):
        run_sandbox("counts", "--run", "order:t:nope")


@pytest.mark.parametrize(
    "args,message",
    [
        (["fault", "tasks", "create", "bogus"], "unknown mode 'bogus'"),
        (["fault", "crm", "create", "slow"], "unknown service 'crm'"),
        (["fault", "messages", "cancel", "slow"], "unknown operation 'cancel'"),
        (["fault", "tasks", "reverse", "late_commit"], "unknown operation 'reverse' for tasks"),
        (["fault", "tasks", "create", "slow", "--times", "-1"], "times must be"),
        (["fault", "tasks", "create", "slow", "--times", "x"], "invalid int value"),
        (["fault", "tasks", "create"], "required"),
        (["explode"], "invalid choice"),
        ([], "required"),
    ],
)
def test_the_command_rejects_bad_input_with_one_line_and_writes_nothing(args, message):
    with pytest.raises(CommandError, match=message) as info:
        run_sandbox(*args)
    assert len(str(info.value).splitlines()) == 1
    assert Fault.objects.count() == 0


def test_the_command_prints_one_line_on_stderr_and_exits_non_zero_from_the_shell(settings):
    result = subprocess.run(
        [sys.executable, str(settings.BASE_DIR / "manage.py"), "sandbox", "fault", "tasks", "create", "bogus"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "config.test_settings"},
    )
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "unknown mode 'bogus'" in result.stderr


# --- Where the rows live ---------------------------------------------------------------


def test_sandbox_rows_live_in_the_sandbox_database_not_the_engines(api):
    for model in (Task, Message, LedgerEntry, Fault):
        assert router.db_for_read(model) == router.db_for_write(model) == "sandbox"
    create_task(api)
    assert Task.objects.get()._state.db == "sandbox"
    assert "sandbox_task" in connections["sandbox"].introspection.table_names()
    assert "sandbox_task" not in connections["default"].introspection.table_names()
