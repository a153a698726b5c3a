"""Fuzzing the console's forms and query strings and the ingestion API with hypothesis (issue
7, hostile input). The properties, for every request:

- the answer is a 2xx/3xx or a clear 4xx (400, 401, 403, 404, 405, 409, 413) — never a 5xx
  (the test client re-raises a view's exception, so a 500 fails the example with its traceback);
- a 4xx carries a message;
- a refused request writes nothing: runs, steps (state, reference, attempts), audit events,
  decisions, faults and tokens (except ``last_used_at``) are as they were.

Each example runs inside a transaction that is rolled back, so examples start from the same
runs; run with DATABASE_URL=postgres://… as well (PostgreSQL refuses NUL characters and
composes the audit export's SQL with client-side quoting)."""

import json
from contextlib import contextmanager
from urllib.parse import quote

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction
from django.test import Client
from django.urls import reverse
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from recovery.api.tokens import issue_token
from recovery.api.views import MAX_BODY_BYTES
from recovery.engine.transitions import run_start, run_version
from recovery.models import ApiToken, AuditEvent, ModelDecision, StepExecution, WorkflowRun
from sandbox.models import Fault
from tests.support import hostile, receivers, workflows
from tests.support.engine import drive

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])

FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,  # no example database under .hypothesis/: every run explores afresh
)
CLEAR_4XX = {400, 401, 403, 404, 405, 409, 413}

# Text a hostile or careless client sends: odd unicode (not lone surrogates, which no form
# encoding can carry), NUL, the XSS payloads, digits that are not ASCII, and long strings.
SPECIAL = st.sampled_from(
    [
        "",
        " ",
        "\x00",
        "a\x00b",
        "²",
        "١٢",
        "9" * 30,
        str(2**63),
        "-1",
        "0",
        "'; DROP TABLE recovery_workflowrun; --",
        "%",
        "_",
        "\\",
        "E'\\x00'",
        "$$",
        "\u202e\u200b\ufeff",
        "😀" * 3,
        "x" * 2001,
        "y" * 300,
        *hostile.PAYLOADS,
    ]
)
TEXT = st.one_of(SPECIAL, st.text(st.characters(exclude_categories=("Cs",)), max_size=40))


class Rollback(Exception):
    pass


@contextmanager
def rolled_back():
    """The example's writes are undone, on both databases, whatever it did."""
    try:
        with transaction.atomic(), transaction.atomic(using="sandbox"):
            yield
            raise Rollback
    except Rollback:
        pass


def snapshot() -> tuple:
    return (
        list(WorkflowRun.objects.order_by("pk").values_list("workflow_id", "state", "status_reason", "updated_at")),
        list(StepExecution.objects.order_by("pk").values_list("state", "remote_ref", "attempts", "last_error")),
        AuditEvent.objects.count(),
        ModelDecision.objects.count(),
        list(ApiToken.objects.order_by("pk").values_list("name", "token_hash", "revoked_at")),
        Fault.objects.using("sandbox").count(),
    )


def check(response, before: tuple) -> None:
    status = response.status_code
    assert status < 500, status
    assert 200 <= status < 400 or status in CLEAR_4XX, status
    if status >= 400:
        body = b"".join(response.streaming_content) if response.streaming else response.content
        assert body.strip(), f"a {status} without a message"
        assert snapshot() == before, f"a refused request ({status}) wrote something"
    elif response.streaming:
        b"".join(response.streaming_content)  # the export's queries run while it streams


def login(role: str) -> Client:
    user = get_user_model().objects.create_user(f"fuzz-{role}", password="pw")
    user.groups.add(Group.objects.get_or_create(name=role)[0])
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def runs(clock, monkeypatch):
    """A failed run (retry, resume, terminate, compensate valid) and one with an unknown step."""
    receivers.arm("task", "forbidden")
    failed = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "fz-1"})[0], clock)
    receivers.arm("message", "commit_then_drop")
    monkeypatch.setattr(workflows.notify, "lookup_fn", lambda ctx: (_ for _ in ()).throw(RuntimeError("down")))
    unknown = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "fz-2"})[0], clock)
    monkeypatch.undo()
    return [failed, unknown]


STEPS = ["read", "decide", "create_task", "notify", "post_entry"]
ACTIONS = ["resume", "retry", "reconcile", "resolve_happened", "resolve_absent", "compensate", "terminate"]


def test_run_actions_never_fail_with_a_5xx_and_a_refusal_writes_nothing(runs):
    client = login("supervisor")

    @FUZZ
    @given(
        which=st.sampled_from([0, 1]),
        action=st.one_of(st.sampled_from(ACTIONS), TEXT),
        step=st.one_of(st.sampled_from(STEPS), TEXT),
        reason=TEXT,
        fresh_version=st.booleans(),
        version=TEXT,
        remote_ref=TEXT,
        htmx=st.booleans(),
        path=st.one_of(st.none(), TEXT),
    )
    def example(which, action, step, reason, fresh_version, version, remote_ref, htmx, path):
        run = runs[which]
        workflow_id = run.workflow_id if path is None else path
        data = {
            "action": action,
            "step": step,
            "reason": reason,
            "version": run_version(run) if fresh_version else version,
            "remote_ref": remote_ref,
        }
        with rolled_back():
            before = snapshot()
            url = "/runs/" + quote(workflow_id, safe="") + "/act"
            response = client.post(url, data, headers={"HX-Request": "true"} if htmx else {})
            check(response, before)

    example()


def test_bulk_actions_never_fail_with_a_5xx_and_a_refusal_writes_nothing(runs):
    client = login("supervisor")
    ids = [r.workflow_id for r in runs]

    @FUZZ
    @given(
        action=st.one_of(st.sampled_from(["resume", "retry", "terminate"]), TEXT),
        reason=TEXT,
        chosen=st.lists(st.one_of(st.sampled_from(ids), TEXT), max_size=4),
        all_matching=st.sampled_from(["", "1", "on"]),
        filters=st.dictionaries(st.sampled_from(["state", "q", "key", "workflow", "stuck", "age", "after"]), TEXT),
    )
    def example(action, reason, chosen, all_matching, filters):
        with rolled_back():
            before = snapshot()
            data = {"action": action, "reason": reason, "run": chosen, "all_matching": all_matching, **filters}
            check(client.post(reverse("console:bulk"), data), before)

    example()


def test_demo_posts_never_fail_with_a_5xx_and_a_refusal_writes_nothing():
    client = login("supervisor")
    numbers = st.one_of(st.integers(-(2**70), 2**70).map(str), TEXT)

    @FUZZ
    @given(
        what=st.one_of(st.sampled_from(["fault", "clear", "start"]), TEXT),
        target=st.one_of(st.sampled_from(["tasks create", "messages send", "ledger post", "tasks"]), TEXT),
        mode=st.one_of(st.sampled_from(["slow", "rate_limit", "forbidden"]), TEXT),
        times=numbers,
        retry_after=numbers,
        delay_ms=numbers,
        invoice_id=st.one_of(st.just("inv-9"), TEXT),
        text=TEXT,
    )
    def example(what, target, mode, times, retry_after, delay_ms, invoice_id, text):
        data = {
            "what": what,
            "target": target,
            "mode": mode,
            "times": times,
            "retry_after": retry_after,
            "delay_ms": delay_ms,
            "invoice_id": invoice_id,
            "text": text,
        }
        with rolled_back():
            before = snapshot()
            check(client.post(reverse("demo"), data), before)

    example()


def test_the_runs_list_answers_every_query_string_without_a_5xx(runs):
    client = login("supervisor")
    keys = st.sampled_from(["state", "q", "key", "workflow", "stuck", "age", "after", "other"])

    @FUZZ
    @given(params=st.dictionaries(keys, TEXT), target=st.sampled_from([None, "counts", "runs-table", "x"]))
    def example(params, target):
        headers = {"HX-Request": "true", "HX-Target": target} if target else {}
        with rolled_back():
            before = snapshot()
            response = client.get(reverse("console:runs"), params, headers=headers)
            check(response, before)
            assert response.status_code == 200 or "\x00" in "".join([*params, *params.values()])

    example()


def test_the_audit_export_answers_every_filter_without_a_5xx(runs):
    """On PostgreSQL the export composes its SQL with client-side quoting: quotes, backslashes,
    percent signs and dollar quotes in the filters must stay data."""
    client = login("viewer")
    instants = st.one_of(
        st.datetimes(timezones=st.none()).map(lambda d: d.isoformat()),
        st.sampled_from(["2026-01-01", "2026-01-01T00:00:00+14:00", "9999-12-31T23:59:59-23:59", "0001-01-01"]),
        TEXT,
    )

    @FUZZ
    @given(
        format=st.one_of(st.sampled_from(["csv", "jsonl", "CSV"]), TEXT),
        run=st.one_of(st.none(), st.sampled_from([r.workflow_id for r in runs]), TEXT),
        since=st.one_of(st.none(), instants),
        until=st.one_of(st.none(), instants),
        workflow=st.one_of(st.none(), st.just("test_orders"), TEXT),
        actor=st.one_of(st.none(), st.just("executor"), TEXT),
        action=st.one_of(st.none(), st.just("start"), TEXT),
    )
    def example(**params):
        params = {k: v for k, v in params.items() if v is not None}
        with rolled_back():
            before = snapshot()
            response = client.get(reverse("console:audit-export"), params)
            check(response, before)

    example()


# --- the ingestion API ------------------------------------------------------------------------

JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    SPECIAL,
)
JSON_VALUE = st.recursive(
    JSON_LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3)
)
# Raw JSON text a serializer would never write: escapes of NUL and lone surrogates, huge or
# infinite numbers, deep nesting, duplicate keys.
ODD_JSON = st.sampled_from(
    [
        '{"tenant": "t", "invoice_id": "i", "text": "\\u0000"}',
        '{"tenant": "t", "invoice_id": "i", "text": "\\udc00x"}',
        '{"tenant": "t", "invoice_id": "i", "text": "x", "n": 1e999}',
        '{"tenant": "t", "invoice_id": "i", "text": "x", "n": -1e999}',
        '{"tenant": "t", "invoice_id": "i", "text": "x", "n": ' + "9" * 5000 + "}",
        '{"tenant": "t", "invoice_id": "i", "text": "x", "d": ' + "[" * 33 + "]" * 33 + "}",
        '{"tenant": "t", "invoice_id": "i", "text": "x", "d": ' + '{"a":' * 500 + "1" + "}" * 500 + "}",
        "[" * 100_000,
        '{"tenant": "t", "tenant": "u", "invoice_id": "i", "text": "x"}',
        '{"tenant": "t", "invoice_id": "i", "text": "' + "x" * 20001 + '"}',
        "\ufeff{}",
        "{}",
        "",
    ]
)
EVENT_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "tenant": st.one_of(st.just("t"), JSON_VALUE),
        "invoice_id": st.one_of(st.just("inv-1"), JSON_VALUE),
        "text": st.one_of(st.just("chairs"), JSON_VALUE),
        "vendor": JSON_VALUE,
    },
)


@st.composite
def bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["event", "value", "odd", "bytes", "huge"]))
    if kind == "event":
        return json.dumps(draw(EVENT_FIELDS)).encode()
    if kind == "value":
        return json.dumps(draw(JSON_VALUE)).encode()
    if kind == "odd":
        return draw(ODD_JSON).encode("utf-8", "surrogatepass")
    if kind == "huge":
        return json.dumps(
            {"tenant": "t", "invoice_id": "i", "text": "x" * (MAX_BODY_BYTES + draw(st.integers(0, 9)))}
        ).encode()
    return draw(st.binary(max_size=64))


def test_the_ingestion_api_never_fails_with_a_5xx_and_a_refusal_writes_nothing():
    token = issue_token(name="erp", workflow_name="invoice")[1]
    orders = issue_token(name="orders", workflow_name="test_orders")[1]
    client = Client()

    @FUZZ
    @given(
        body=bodies(),
        workflow=st.one_of(st.sampled_from(["invoice", "test_orders"]), TEXT),
        auth=st.one_of(st.sampled_from(["invoice", "orders", "none"]), TEXT),
        content_type=st.sampled_from(["application/json", "text/plain", "multipart/form-data; boundary=x", ""]),
        content_length=st.one_of(st.none(), st.sampled_from(["-1", "abc", "0", "1", str(10**30), str(MAX_BODY_BYTES)])),
        method=st.sampled_from(["post", "post", "post", "put", "get"]),
    )
    def example(body, workflow, auth, content_type, content_length, method):
        headers = {}
        if auth != "none":
            headers["Authorization"] = f"Bearer {token if auth == 'invoice' else orders if auth == 'orders' else auth}"
        # A declared length within the limit but longer than the body is a client still sending:
        # a server waits for the rest (and times out). Django's test client cannot stand for
        # that (it asserts instead of returning a short read), so such a lie is not sent; one
        # over the limit (refused before the body is read) and one shorter than the body are.
        lie = content_length is not None and content_length.isdigit()
        assume(not (lie and len(body) < int(content_length) <= MAX_BODY_BYTES))
        extra = {"CONTENT_LENGTH": content_length} if content_length is not None else {}
        url = "/api/events/" + quote(workflow, safe="")
        with rolled_back():
            before = snapshot()
            if method == "get":
                response = client.get(url, headers=headers)
            else:
                response = getattr(client, method)(url, data=body, content_type=content_type, headers=headers, **extra)
            check(response, before)
            if response.status_code != 404 or response.get("Content-Type", "").startswith("application/json"):
                assert "error" in response.json() or response.status_code < 300

    example()
