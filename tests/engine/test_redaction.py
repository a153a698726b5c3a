"""Secrets and sensitive data (issue 7; contract rule 6): checkpoints, audit events, exports and logs
never hold a credential. recovery.redaction's rules, then the engine's use of them, then a run
of everything with planted secrets, greping a dump of the whole database, both exports and the
logs for them."""

from __future__ import annotations

import io
import json
import logging
import sqlite3
import subprocess
import sys
import timeit
import uuid
from io import StringIO

import httpx
import pytest
from django.core.management import call_command
from django.db import connections
from django.test import Client

from recovery.api import tokens
from recovery.engine import transitions
from recovery.engine.audit.export import AuditFilters, export_chunks
from recovery.engine.executor import advance
from recovery.errors import PermanentError, TransientError, UnknownOutcome
from recovery.logs import JsonFormatter
from recovery.models import (
    AuditEvent,
    DecisionState,
    ModelDecision,
    OutboxMessage,
    OutboxState,
    RunState,
    StepExecution,
    StepState,
    WorkflowRun,
)
from recovery.redaction import MARKER, RedactingFilter, redact, redact_text
from recovery.workflow import get_workflow, payload_hash
from sandbox import faults
from tests.support import receivers
from tests.support.engine import crash_at, drive, person
from tests.support.model_server import VALID_DECISION, Reply, completion
from workflows.integrations import adapters

KEY = "sk-proj-unit0123456789abcdefghijkl"


# --- the rules -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["password", "PASSWORD", "db_password", "api_key", "X-Api-Key", "apikey", "Authorization", "Set-Cookie"]
)
def test_a_key_named_like_a_credential_has_its_value_replaced_at_any_depth(name):
    data = {"outer": [{name: "s3cr3t-value", "kept": "visible"}], "n": 1}
    assert redact(data) == {"outer": [{name: MARKER, "kept": "visible"}], "n": 1}


@pytest.mark.parametrize("name", ["prompt_tokens", "token_count", "idempotency_key", "tokenizer", "secretary"])
def test_a_key_that_only_contains_a_credential_word_is_kept(name):
    assert redact({name: "value"}) == {name: "value"}


@pytest.mark.parametrize(
    "text,marker",
    [
        ("token rc_" + "A" * 43 + " pasted", "[REDACTED:ingestion_token]"),
        ("Authorization: Bearer abc.def-ghi_jkl", "Authorization: Bearer [REDACTED]"),
        ("curl -H 'x: Bearer abcdefghijkl'", "[REDACTED:bearer]"),
        ("key sk-" + "b" * 30, "[REDACTED:openai_key]"),
        ("aws AKIAABCDEFGHIJKLMNOP", "[REDACTED:aws_access_key]"),
        ("jwt eyJhbGciOiJIUzI1.eyJzdWIiOiIxMjM0.sig_part", "[REDACTED:jwt]"),
        ("-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----", "[REDACTED:private_key]"),
        ("GET /v1/items?api_key=plainvalue&page=2", "api_key=[REDACTED]&page=2"),
        ('{"password": "pw-in-json-text"}', '"password": "[REDACTED]"'),
    ],
)
def test_a_credential_written_in_a_string_is_replaced_by_its_marker(text, marker):
    out = redact_text(text)
    assert marker in out
    for secret in ("A" * 43, "abc.def-ghi_jkl", "abcdefghijkl", "b" * 30, "ABCDEFGHIJKLMNOP", "MIIE", "plainvalue"):
        assert secret not in out
    assert "pw-in-json-text" not in out


def test_ordinary_text_is_kept_byte_for_byte():
    text = "ACME Office Supply — 40 chairs. Total due: EUR 1,840.00; task task_12 for finance@example.com"
    assert redact_text(text) == text


def test_the_deployment_s_known_secrets_are_replaced_wherever_they_appear(settings):
    settings.OPENAI_API_KEY = "custom-openai-key-without-any-prefix"
    settings.SANDBOX_API_KEY = "sandbox-token-0001"
    settings.SECRET_KEY = "django-secret-key-planted-here"
    out = redact_text("a custom-openai-key-without-any-prefix b sandbox-token-0001 c django-secret-key-planted-here d")
    assert out == "a [REDACTED:OPENAI_API_KEY] b [REDACTED:SANDBOX_API_KEY] c [REDACTED:SECRET_KEY] d"


def test_a_known_secret_too_short_to_be_told_from_text_is_not_looked_for(settings):
    settings.OPENAI_API_KEY = "abc"
    assert redact_text("abc of accounting") == "abc of accounting"


def test_redaction_is_deterministic_idempotent_and_leaves_its_input_unchanged(settings):
    settings.OPENAI_API_KEY = KEY
    data = {"note": f"key {KEY}", "token": "t-1", "list": ["Bearer abcdefghijkl", 3, None], "ok": "fine"}
    original = json.loads(json.dumps(data))
    once = redact(data)
    assert data == original  # not modified in place
    assert once == redact(json.loads(json.dumps(data)))  # the same output for the same input
    assert redact(once) == once  # a second pass changes nothing: hashes of redacted data are stable
    assert once["ok"] == "fine" and KEY not in json.dumps(once)


def test_data_with_nothing_to_redact_is_returned_itself_and_empty_credentials_are_kept():
    data = {"title": "Approve invoice inv-1: 10.00 EUR", "payload": {"amount": "10.00"}, "token": None, "secret": ""}
    assert redact(data) is data


def test_a_string_seen_before_is_redacted_the_same_and_a_clean_one_is_returned_itself(settings):
    settings.OPENAI_API_KEY = KEY
    secret, clean = f"ref {KEY}", "ordinary-remote-ref-0042"
    first = [redact_text(secret), redact_text(clean)]
    again = [redact_text("".join(["ref ", KEY])), redact_text("".join(["ordinary-remote-ref-", "0042"]))]
    assert first == again == ["ref [REDACTED:OPENAI_API_KEY]", clean]
    fresh = "".join(["ordinary-remote-ref-", "0042"])  # equal, not the same object: the memo gives it back
    assert redact({"remote_ref": fresh})["remote_ref"] is fresh
    settings.OPENAI_API_KEY = "another-key-now-in-use"  # a changed setting: the memo is dropped
    assert redact_text("another-key-now-in-use") == "[REDACTED:OPENAI_API_KEY]"
    assert redact_text(secret) == "ref [REDACTED:openai_key]"  # by its pattern now, not from the memo


def test_the_settings_extend_and_replace_the_rules(settings):
    settings.RECOVERY_REDACT_FIELDS = ["iban"]
    settings.RECOVERY_REDACT_PATTERNS = {"card": r"\b4[0-9]{15}\b"}
    assert redact({"iban": "DE89", "password": "kept-now"}) == {"iban": MARKER, "password": "kept-now"}
    assert redact_text("card 4111111111111111 ok") == "card [REDACTED:card] ok"


def test_a_workflow_adds_its_own_sensitive_fields():
    workflow = get_workflow("test_secrets")
    assert workflow.redact({"iban": "DE89370400440532013000"}) == {"iban": MARKER}
    assert redact({"iban": "DE89370400440532013000"}) == {"iban": "DE89370400440532013000"}  # not global


def test_the_request_hash_of_a_redacted_intent_still_tells_a_changed_request_from_a_repeat():
    """The executor hashes the redacted intent it sends: a change of the business request changes
    the hash, a credential (which the request never carries) does not, and none is hashed."""
    a = redact({"amount": "10.00", "api_key": "first-key"})
    assert payload_hash(a) == payload_hash(redact({"amount": "10.00", "api_key": "rotated-key"}))
    assert payload_hash(a) != payload_hash(redact({"amount": "11.00", "api_key": "first-key"}))


def test_redacting_a_checkpoint_costs_microseconds():
    intent = {
        "title": "Approve invoice inv-1847: 1840.00 EUR",
        "assignee": "finance@example.com",
        "payload": {"tenant": "tenant-42", "invoice_id": "inv-1847", "category": "office_supplies", "amount": "1840"},
    }
    snapshot = {"run": "running", "step": "succeeded", "attempts": 1}
    redact(intent)  # compiled once
    n = 2000
    assert timeit.timeit(lambda: redact(intent), number=n) / n < 200e-6  # ~15 µs here; bound for a busy machine
    assert timeit.timeit(lambda: redact(snapshot), number=n) / n < 50e-6  # short strings are not searched


# --- logs ----------------------------------------------------------------------------------


def test_a_log_record_is_redacted_in_its_message_its_arguments_and_its_traceback(settings):
    settings.OPENAI_API_KEY = KEY
    try:
        raise RuntimeError(f"failed with {KEY}")
    except RuntimeError:
        record = logging.LogRecord("recovery.x", logging.ERROR, __file__, 1, "calling with %s", (KEY,), sys.exc_info())
    RedactingFilter().filter(record)
    formatted = logging.Formatter().format(record)
    assert KEY not in formatted and formatted.count("[REDACTED:OPENAI_API_KEY]") == 2
    assert "RuntimeError" in formatted  # the traceback is kept, as redacted text
    assert record.exc_info is None  # no handler renders the exception (or its frames) itself


def test_the_console_handler_redacts_and_every_record_is_redacted_where_it_is_created(settings, caplog):
    settings.OPENAI_API_KEY = KEY
    console = next(h for h in logging.getLogger("recovery").handlers if isinstance(h, logging.StreamHandler))
    assert any(isinstance(f, RedactingFilter) for f in console.filters)
    for name in ("recovery.engine.executor", "workflows.integrations.openai", "django.request", "celery.worker"):
        with caplog.at_level(logging.INFO, logger=name):
            logging.getLogger(name).warning("key %s, Authorization: Bearer abcdefghijkl", KEY)
    assert len(caplog.records) == 4
    assert KEY not in caplog.text and "abcdefghijkl" not in caplog.text
    assert caplog.text.count("[REDACTED:OPENAI_API_KEY]") == 4


# --- the engine ----------------------------------------------------------------------------


def test_adapters_send_their_token_from_settings_and_redact_an_echo_of_it(settings):
    settings.SANDBOX_API_KEY = "sandbox-token-planted-0002"
    seen = []

    def handler(request):
        seen.append(request.headers.get("authorization"))
        return httpx.Response(401, json={"error": "x" * 180 + " bad token sandbox-token-planted-0002"})

    client = adapters.SandboxClient(base_url="http://sandbox.test", transport=httpx.MockTransport(handler))
    with pytest.raises(PermanentError) as raised:
        adapters.find_task(key="k", client=client)
    assert seen == ["Bearer sandbox-token-planted-0002"]
    # redacted before the detail is cut at 200 characters, 9 characters into the token: no part is left
    assert "sandbox-t" not in raised.value.message and raised.value.message.endswith("bad token [REDACTED")


@pytest.mark.django_db
def test_what_is_persisted_is_what_is_replayed(clock, settings, monkeypatch):
    """A run that never crashed and a run replayed from its checkpoints after a crash call every
    step with the same (redacted) intent, built from the same (redacted) results: the executor
    goes on with what it persisted, never with the secrets it was handed."""
    settings.OPENAI_API_KEY = KEY
    settings.SANDBOX_API_KEY = "sandbox-token-planted-0003"
    receivers.PLANTED.update(ingestion="rc_" + "C" * 43, password="pw-0003")
    run, _ = transitions.run_start(workflow="test_secrets", data={"tenant": "t", "order_id": "straight", "text": "x"})
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    fetch = StepExecution.objects.get(run=run, step_name="fetch")
    called_with = dict(receivers.CALLS)
    assert called_with["fetch"] == fetch.intent  # the call got what was checkpointed
    assert fetch.intent["api_key"] == MARKER and fetch.intent["iban"] == MARKER
    assert fetch.intent["url"] == "https://api.example/v1?key=[REDACTED:OPENAI_API_KEY]"
    assert fetch.result == {"echo": "key=[REDACTED:OPENAI_API_KEY]", "session": {"access_token": MARKER}, "text": "x"}
    create = StepExecution.objects.get(run=run, step_name="create")
    assert called_with["create"] == create.intent and create.intent["echo"] == fetch.result["echo"]
    assert OutboxMessage.objects.get(run=run).payload == called_with["tell"]  # the publisher sent the stored payload
    assert called_with["tell"]["api_key"] == MARKER

    straight = list(receivers.CALLS)
    receivers.CALLS.clear()
    replayed, _ = transitions.run_start(workflow="test_secrets", data={"tenant": "t", "order_id": "crash", "text": "x"})
    crash_at(monkeypatch, "fetch:after_outcome", lambda: advance(replayed.pk))
    replayed = drive(replayed, clock)
    assert replayed.state == RunState.COMPLETED
    assert receivers.CALLS == straight
    assert StepExecution.objects.get(run=replayed, step_name="create").intent == create.intent


# --- everything at once: planted secrets, a dump of the whole database, the exports, the logs ---


def _dump(alias: str) -> str:
    conn = connections[alias]
    db = conn.settings_dict
    if conn.vendor == "sqlite":
        with sqlite3.connect(db["NAME"]) as dump:
            return "\n".join(dump.iterdump())
    assert conn.vendor == "postgresql"
    command = ["pg_dump", "--no-owner", "-h", db["HOST"] or "127.0.0.1", "-p", str(db["PORT"] or 5432)]
    command += ["-U", db["USER"], db["NAME"]]
    env = {"PGPASSWORD": db["PASSWORD"]} if db.get("PASSWORD") else {}
    done = subprocess.run(command, capture_output=True, text=True, env={**_path_env(), **env}, check=True)
    return done.stdout


def _path_env() -> dict[str, str]:
    import os

    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


@pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_planted_secrets_reach_no_checkpoint_audit_event_export_or_log_line(
    clock,
    settings,
    stub,  # noqa: F811
    live_server,
    caplog,
    log_format,
):
    """Rule 6: plant every credential the deployment knows (the model API key, the adapters'
    token, an ingestion token, DJANGO_SECRET_KEY) and credentials pasted into events, echoed by
    the model, the adapters and remote systems in results and errors, typed by operators; run
    through retries, an invalid model output, an unknown outcome, a failure, compensations
    and a termination; then none of them is anywhere in a dump of the whole database (ours
    and the simulated systems': what we sent them), in either export or in the logs — and the
    markers that replaced them are."""
    uid = uuid.uuid4().hex
    key = f"sk-proj-PLANTED{uid}"
    sandbox_token = f"sbxPLANTED{uid}"  # no pattern knows it: only "a known secret" can catch it
    secret_key = f"djangoPLANTED{uid}"
    password = f"pwPLANTED{uid}"  # only ever under a "password" key
    field_key = f"fkPLANTED{uid}"  # only ever under an "api_key" key
    bearer = f"brPLANTED{uid}"  # only ever after "Bearer "
    iban = "DE89370400440532013000"  # test_secrets's own sensitive field
    settings.SANDBOX_URL = live_server.url
    settings.OPENAI_API_KEY, settings.SANDBOX_API_KEY, settings.SECRET_KEY = key, sandbox_token, secret_key
    settings.MODEL_PROVIDER, settings.OPENAI_BASE_URL = "openai", stub.base_url
    faults.clear()
    _, ingestion = tokens.issue_token(name="erp", workflow_name="invoice")
    receivers.PLANTED.update(ingestion=ingestion, password=password)
    planted = {
        "api key": key,
        "sandbox token": sandbox_token,
        "secret key": secret_key,
        "ingestion token": ingestion,
        "password": password,
        "api_key field": field_key,
        "bearer": bearer,
        "iban": iban,
    }
    sam = person("sam")
    console = next(h for h in logging.getLogger("recovery").handlers if isinstance(h, logging.StreamHandler))
    console_out = io.StringIO()
    previous_stream = console.setStream(console_out)
    previous_formatter = console.formatter
    if log_format == "json":  # RECOVERY_LOG_FORMAT=json
        console.setFormatter(JsonFormatter())
    loggers = [logging.getLogger(n) for n in ("recovery", "workflows")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
    try:
        with (
            caplog.at_level(logging.DEBUG),
            caplog.at_level(logging.DEBUG, logger="recovery"),
            caplog.at_level(logging.DEBUG, logger="workflows"),
            caplog.at_level(logging.DEBUG, logger="celery"),
            caplog.at_level(logging.DEBUG, logger="django"),
        ):
            runs = _run_everything(planted, sam, clock, stub)
    finally:
        console.setStream(previous_stream)
        console.setFormatter(previous_formatter)
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)

    # the runs went where they were sent
    assert {name: run.state for name, run in runs.items()} == {
        "secrets": RunState.COMPENSATED,
        "exploded": RunState.TERMINATED,
        "invoice": RunState.COMPENSATED,
        "refused": RunState.TERMINATED,
    }
    steps = {s.step_name: s for s in StepExecution.objects.filter(run=runs["secrets"])}
    assert steps["create"].state == StepState.COMPENSATED and steps["settle"].state == StepState.FAILED
    assert AuditEvent.objects.filter(run=runs["secrets"], action="step_unknown").count() == 1
    assert AuditEvent.objects.filter(run=runs["secrets"], action="compensation_retry").count() == 1
    assert OutboxMessage.objects.get(run=runs["secrets"]).state == OutboxState.DELIVERED
    assert ModelDecision.objects.filter(state=DecisionState.INVALID).count() == 2  # one per workflow
    invoice_steps = {s.step_name: s.last_error_kind for s in StepExecution.objects.filter(run=runs["invoice"])}
    assert invoice_steps["create_approval_task"] == "unknown_outcome"
    assert faults.counts()["tasks"] == 1 and faults.counts()["tasks_cancelled"] == 1
    assert len(stub.requests) == 4 and all(r.headers["authorization"] == f"Bearer {key}" for r in stub.requests)
    # the model was sent the redacted invoice text, never a credential
    assert all(secret not in json.dumps(r.body) for r in stub.requests for secret in planted.values())

    csv_export = "".join(export_chunks(AuditFilters(format="csv")))
    jsonl_export = "".join(export_chunks(AuditFilters(format="jsonl")))
    command_export = StringIO()
    call_command("export_audit", "--format", "jsonl", stdout=command_export)
    texts = {
        "database dump": _dump("default"),
        "sandbox database dump": _dump("sandbox"),
        "CSV export": csv_export,
        "JSON Lines export": jsonl_export,
        "export_audit": command_export.getvalue(),
        "captured logs": caplog.text,
        "console log": console_out.getvalue(),
    }
    leaks = [(what, where) for where, text in texts.items() for what, secret in planted.items() if secret in text]
    assert leaks == []

    # ... and the secrets were there to be found: their markers took their places
    dump = texts["database dump"]
    for marker in ("[REDACTED:OPENAI_API_KEY]", "[REDACTED:SANDBOX_API_KEY]", "[REDACTED:SECRET_KEY]"):
        assert marker in dump
    assert "[REDACTED:ingestion_token]" in dump and '"password": "[REDACTED]"' in dump
    assert "Bearer [REDACTED]" in dump and '"iban": "[REDACTED]"' in dump
    for where in ("CSV export", "JSON Lines export", "export_audit"):
        assert "[REDACTED:ingestion_token]" in texts[where]  # the operator's reason
        assert "[REDACTED:OPENAI_API_KEY]" in texts[where]  # a remote error in a retry's reason
    for where in ("captured logs", "console log"):
        assert "fetched with key [REDACTED:OPENAI_API_KEY] via [REDACTED:SANDBOX_API_KEY]" in texts[where]
    assert "model call failed" in caplog.text and "[REDACTED" in caplog.text
    if log_format == "json":
        _every_line_is_a_json_record_and_the_engine_s_say_what_they_are_about(console_out.getvalue(), runs)


def _every_line_is_a_json_record_and_the_engine_s_say_what_they_are_about(text: str, runs: dict) -> None:
    records = [json.loads(line) for line in text.splitlines()]  # a line that is not JSON fails here
    assert records and all({"time", "level", "logger", "message"} <= set(r) for r in records)
    transitions = [r for r in records if r["logger"] == "recovery.transitions"]
    ids = {run.workflow_id for run in runs.values()}
    assert transitions and {r["workflow_id"] for r in transitions} == ids
    assert all({"workflow", "action", "actor", "lease_generation"} <= set(r) for r in transitions)
    # An executor's record about a step carries the step, its attempt and its key's prefix.
    unknown = next(r for r in transitions if r["action"] == "step_unknown" and r["workflow"] == "invoice")
    step = StepExecution.objects.get(run=runs["invoice"], step_name=unknown["step"])
    assert unknown["actor"] == "executor" and unknown["attempt"] >= 1
    assert unknown["key"] == step.idempotency_key[:16]
    assert any(r["action"] == "terminate" and r["actor"] == "sam" for r in transitions)


def _run_everything(planted: dict[str, str], sam, clock, stub) -> dict[str, WorkflowRun]:  # noqa: F811
    key, ingestion, sandbox_token = planted["api key"], planted["ingestion token"], planted["sandbox token"]
    bearer, password = planted["bearer"], planted["password"]
    pasted = (
        f"key {key}; token {ingestion}; Authorization: Bearer {bearer}; django {planted['secret key']}; "
        f"sandbox {sandbox_token}"
    )
    runs = {}

    # 1. the secrets workflow: a retry, an invalid model output, an unknown outcome, an outbox
    #    retry, a permanent failure; then an operator compensates (one compensation retried)
    receivers.RAISES["fetch"].append(TransientError(f"connect failed: Authorization: Bearer {sandbox_token}"))
    receivers.MODEL_SCRIPT.extend(
        [
            json.dumps({"category": key, "amount": 5, "approver": "x"}),
            json.dumps({"category": "office", "amount": 5, "approver": f"ops {ingestion}"}),
        ]
    )
    receivers.RAISES["create"].append(UnknownOutcome(f"timed out after sending with {key}"))
    receivers.RAISES["tell"].append(TransientError(f"messenger 503 for api_key={key}"))
    receivers.RAISES["settle"].append(PermanentError(f"ledger refused: api_key={key} password={password}"))
    receivers.RAISES["create.compensate"].append(TransientError(f"delete refused for {key}"))
    data = {"tenant": "t", "order_id": "a", "text": pasted, "password": password, "api_key": planted["api_key field"]}
    run, _ = transitions.run_start(workflow="test_secrets", data=data, actor="api:erp")
    run = drive(run, clock)
    assert run.state == RunState.FAILED, run.status_reason
    transitions.run_compensate(
        workflow_id=run.workflow_id, actor=sam, reason=f"customer pasted {ingestion} and Bearer {bearer}"
    )
    runs["secrets"] = drive(run, clock)

    # 2. an unclassified exception quoting the key: review, then terminated with a pasted token
    data = {"tenant": "t", "order_id": "b", "text": "x", "explode": True}
    run, _ = transitions.run_start(workflow="test_secrets", data=data)
    run = drive(run, clock)
    assert run.state == RunState.NEEDS_REVIEW, run.status_reason
    transitions.run_terminate(workflow_id=run.workflow_id, actor=sam, reason=f"Authorization: Bearer {bearer}")
    run.refresh_from_db()
    runs["exploded"] = run

    # 3. the invoice workflow, started through the ingestion API with the token, credentials
    #    pasted in its text and fields; the model echoes the key in a 429 and in an invalid
    #    output and quotes the pasted credentials in its rationale; the task's answer is lost;
    #    the ledger refuses; an operator compensates
    stub.reply(
        Reply(429, {"error": {"message": f"Rate limit reached for key {key}"}}, headers={"Retry-After": "1"}),
        Reply(200, completion(f'{{"category": "{key}"')),
        Reply(200, completion(json.dumps({**VALID_DECISION, "rationale": f"Quoted Bearer {bearer} and {ingestion}"}))),
        Reply(401, {"error": {"message": f"Incorrect API key provided: {key}"}}),
    )
    faults.set_fault("tasks", "create", "commit_then_drop")
    faults.set_fault("ledger", "post", "forbidden")
    event = {
        "tenant": "tenant-42",
        "invoice_id": "inv-secret-1",
        "text": f"40 ergonomic chairs. Total due: EUR 1,840.00. {pasted}",
        "password": password,
        "api_key": planted["api_key field"],
    }
    response = Client().post(
        "/api/events/invoice",
        data=event,
        content_type="application/json",
        headers={"Authorization": f"Bearer {ingestion}"},
    )
    assert response.status_code == 201, response.content
    run = WorkflowRun.objects.get(workflow_id=response.json()["workflow_id"])
    run = drive(run, clock)
    assert run.state == RunState.FAILED, run.status_reason
    transitions.run_compensate(workflow_id=run.workflow_id, actor=sam, reason=f"duplicate; pasted {ingestion}")
    runs["invoice"] = drive(run, clock)

    # 4. the model refuses the key (and quotes it): failed for good, then terminated
    run, _ = transitions.run_start(
        workflow="invoice",
        data={"tenant": "tenant-42", "invoice_id": "inv-secret-2", "text": f"chairs EUR 10.00 {key}"},
    )
    run = drive(run, clock)
    assert run.state == RunState.FAILED, run.status_reason
    transitions.run_terminate(workflow_id=run.workflow_id, actor=sam, reason=f"rotate {key} first")
    run.refresh_from_db()
    runs["refused"] = run
    return runs


def test_a_nul_character_is_stored_as_a_replacement_character():
    assert redact_text("bad\x00request") == "bad\ufffdrequest"
    assert redact({"error": ["a\x00"]}) == {"error": ["a\ufffd"]}
    assert redact_text(redact_text("x\x00y")) == "x\ufffdy"


@pytest.mark.django_db
def test_a_remote_error_with_a_nul_character_is_recorded_and_the_run_stops_as_its_kind_says(clock, monkeypatch):
    """PostgreSQL cannot store NUL in text: unreplaced, every attempt to record this failure
    would fail, and the run would stop as an executor error instead of a permanent one."""
    from tests.support import workflows as test_workflows

    def refuse(ctx):
        raise PermanentError("tracker said: bad\x00request")

    monkeypatch.setattr(test_workflows.create_task, "call", refuse)
    run = drive(transitions.run_start(workflow="test_orders", data={"tenant": "t", "order_id": "nul"})[0], clock)

    step = run.steps.get(step_name="create_task")
    assert run.state == RunState.FAILED and "executor error" not in run.status_reason
    assert step.last_error == "tracker said: bad\ufffdrequest"
    assert run.audit_events.get(action="step_fail").reason == "tracker said: bad\ufffdrequest"
