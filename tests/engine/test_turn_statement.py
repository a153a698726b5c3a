"""An agent's turn, recorded with the tool calls it asks for, is one statement on PostgreSQL
(storage.checkpoint_adding: the fenced UPDATE of the run, the changed steps, the new journal
rows from one JSON document, the audit event) and one transaction elsewhere. Here twin runs
record the same turns on both paths and the rows they leave are compared field by field — the
journal rows in the order of their ids, the audit chain intact — and the executor's copy of a
new row is what ``row.save()`` would have left. A fence miss writes none of it; and an agent
driven to its end writes each of its turns in one statement."""

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from recovery.engine import transitions
from recovery.engine.agent import NewCall
from recovery.engine.audit.chain import stored_chains, verify
from recovery.engine.transitions import Draft, FenceMiss, checkpoints, run_claim, run_start
from recovery.engine.transitions._core import _save_run
from recovery.models import AuditEvent, RunState, StepExecution, StepState, WorkflowRun
from tests.support import receivers
from tests.support.engine import assert_invariants, drive
from tests.support.workflows import JOURNAL

pytestmark = pytest.mark.django_db

ONE_STATEMENT_SKIP = "the one-statement checkpoint is PostgreSQL's (set DATABASE_URL=postgres://…)"
AT = datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)

# Fields that differ between twins by construction: their own ids and what the event makes.
RUN_OWN = {"id", "workflow_id", "input", "input_hash"}
STEP_OWN = {"id", "run", "idempotency_key"}
AUDIT_OWN = {"id", "run", "prev_hash", "hash"}


def fields(obj, own: set[str]) -> dict[str, Any]:
    return {f.name: getattr(obj, f.attname) for f in obj._meta.concrete_fields if f.name not in own}


def rows(run: WorkflowRun) -> tuple[dict, list[dict], list[str], list[dict]]:
    """The run, its steps in order, its step names in the order of their ids, its audit events."""
    run = WorkflowRun.objects.get(pk=run.pk)
    steps = [fields(s, STEP_OWN) for s in run.steps.order_by("position", "id")]
    by_id = list(run.steps.order_by("id").values_list("step_name", flat=True))
    audit = [fields(a, AUDIT_OWN) for a in run.audit_events.order_by("id")]
    return fields(run, RUN_OWN), steps, by_id, audit


@pytest.fixture
def postgresql():
    if connection.vendor != "postgresql":
        pytest.skip(ONE_STATEMENT_SKIP)


def transaction_path(monkeypatch) -> None:
    """Every checkpoint that inserts rows written as one transaction, as on SQLite."""

    def one_statement(run_pk, run_values, fence, updates, events, draft, rows):
        if not rows:
            return one_statement.real(run_pk, run_values, fence, updates, events, draft, rows)
        return checkpoints._one_transaction(run_pk, run_values, fence, updates, rows, events)

    one_statement.real = checkpoints._one_statement
    monkeypatch.setattr(checkpoints, "_one_statement", one_statement)


def verb(sql: str) -> str:
    """A logged statement's first word (a prepared one is logged as ``QUERY = '<sql>' …``)."""
    return sql.removeprefix("QUERY = '").removeprefix('QUERY = "').split()[0].upper()


def writes(queries) -> list[str]:
    return [
        verb(q["sql"])
        for q in queries.captured_queries
        if verb(q["sql"]) not in ("BEGIN", "SAVEPOINT", "RELEASE", "COMMIT")
    ]


CALLS = [
    NewCall("resolve:1:0:find_invoice", "find_invoice", {"invoice": "inv-1", "note": "größe 値 ✓"}),
    NewCall("resolve:1:1:credit", "credit", {"invoice": "inv-1", "amount": 10**15}),
    NewCall("resolve:1:2:refund", "refund", {"x": 1}, error="no such tool: refund"),
]


def begin_turn(order_id: str):
    """A claimed test_agent run whose first model turn is added and begun: the turn to record."""
    run = run_start(workflow="test_agent", data={"tenant": "t", "order_id": order_id, "invoice": "inv-1"})[0]
    lease = run_claim(run_pk=run.pk, now=AT)
    transitions.agent_turn_add(lease=lease, agent="resolve", turn=1, key_version=1, now=AT)
    transitions.step_begin(lease=lease, step_name="resolve:1", intent={"turn": 1}, request_hash="h", now=AT)
    return run, lease


def record_turn(lease, calls=CALLS, now=AT + timedelta(seconds=1)) -> StepExecution:
    return transitions.agent_turn_record(
        lease=lease,
        agent="resolve",
        step_name="resolve:1",
        reply={"content": None, "tool_calls": [{"name": c.tool, "arguments": c.arguments} for c in calls]},
        calls=calls,
        key_versions={"find_invoice": 1, "credit": 2},
        final=None,
        complete_run=False,
        now=now,
    )


def record_final(lease, now=AT + timedelta(seconds=2)) -> None:
    """The next turn added, begun and answered with the final answer: the run completes."""
    transitions.agent_turn_add(lease=lease, agent="resolve", turn=2, key_version=1, now=now)
    transitions.step_begin(lease=lease, step_name="resolve:2", intent={"turn": 2}, request_hash="h2", now=now)
    transitions.agent_turn_record(
        lease=lease,
        agent="resolve",
        step_name="resolve:2",
        reply={"content": "done"},
        calls=[],
        key_versions={},
        final={"resolution": "credited", "amount": 120},
        complete_run=True,
        now=now,
    )


def test_a_turn_recorded_in_one_statement_leaves_the_rows_of_one_transaction(postgresql, clock, monkeypatch):
    one, one_lease = begin_turn("twin-a")
    record_turn(one_lease)
    record_final(one_lease)
    transaction_path(monkeypatch)
    other, other_lease = begin_turn("twin-b")
    record_turn(other_lease)
    record_final(other_lease)

    assert rows(one) == rows(other)
    run, steps, by_id, audit = rows(one)
    assert run["state"] == RunState.COMPLETED
    # The journal rows in the order they were written (their ids), on both paths.
    assert by_id == [
        "resolve",
        "close",
        "resolve:1",
        "resolve:1:0:find_invoice",
        "resolve:1:1:credit",
        "resolve:1:2:refund",
        "resolve:2",
    ]
    written = {s["step_name"]: s for s in steps}
    assert written["resolve:1:0:find_invoice"]["intent"] == {"invoice": "inv-1", "note": "größe 値 ✓"}
    assert written["resolve:1:1:credit"]["intent"]["amount"] == 10**15
    assert written["resolve:1:1:credit"]["key_version"] == 2
    assert written["resolve:1:0:find_invoice"]["updated_at"] == AT + timedelta(seconds=1)
    assert written["resolve:1:0:find_invoice"]["result"] is None  # SQL NULL on both paths
    refused = written["resolve:1:2:refund"]
    assert (refused["state"], refused["last_error"]) == (StepState.SKIPPED, "no such tool: refund")
    assert [a["action"] for a in audit][-3:] == ["agent_turn_add", "step_begin", "agent_turn"]
    for twin in (one, other):
        assert verify(stored_chains(run=twin.workflow_id)).broken_runs == 0
        assert StepExecution.history.filter(run_id=twin.pk).count() == 0  # the executor's own writes
    assert StepExecution.objects.filter(run__in=[one, other], result__isnull=True).count() == 2 * 4


@pytest.mark.parametrize("path", ["one statement", "transaction"])
def test_the_executor_s_copy_of_a_new_row_is_what_save_leaves(clock, monkeypatch, path):
    if path == "transaction":
        transaction_path(monkeypatch)
    elif connection.vendor != "postgresql":
        pytest.skip(ONE_STATEMENT_SKIP)
    run, lease = begin_turn("copy")
    record_turn(lease)

    copy = lease.seen["steps"]
    for stored in run.steps.all():
        mine = copy[stored.step_name]
        assert (mine.pk, mine._state.adding, mine._state.db) == (stored.pk, False, "default")
        assert fields(mine, set()) == fields(stored, set())
    journal = [s.step_name for s in transitions.leased_run(lease)[1] if s.step_name.startswith("resolve:")]
    assert journal == ["resolve:1", "resolve:1:0:find_invoice", "resolve:1:1:credit", "resolve:1:2:refund"]


def test_an_agent_turn_with_two_calls_is_one_statement_on_postgresql(postgresql, clock, monkeypatch):
    """The turn's UPDATE, two new rows and its audit event: one ``WITH fenced AS`` statement,
    where one transaction takes an UPDATE of the run, one of the turn, an INSERT per call and
    the audit INSERT."""
    counted = {}
    for path in ("one statement", "transaction"):
        if path == "transaction":
            transaction_path(monkeypatch)
        _, lease = begin_turn(f"count-{path[0]}")
        with CaptureQueriesContext(connection) as queries:
            record_turn(lease, calls=CALLS[:2])
        counted[path] = writes(queries)
    assert counted["one statement"] == ["WITH"], counted
    assert counted["transaction"] == ["UPDATE", "UPDATE", "INSERT", "INSERT", "INSERT"], counted


def test_the_turn_statement_is_the_same_text_whatever_the_calls(postgresql, clock):
    """The new rows go as one JSON parameter: one text to prepare for one call or three."""
    texts = []
    for index, calls in enumerate((CALLS[:1], CALLS)):
        _, lease = begin_turn(f"text-{index}")
        with CaptureQueriesContext(connection) as queries:
            record_turn(lease, calls=calls)
        (sql,) = [q["sql"] for q in queries.captured_queries if "WITH fenced AS" in q["sql"]]
        texts.append(sql.split(" - PARAMS = ")[0])
    assert texts[0] == texts[1]


def test_a_fence_miss_writes_none_of_the_turn(clock):
    run, lease = begin_turn("missed")
    draft = Draft.read(lease)
    transitions.agent_turn_add(lease=lease, agent="resolve", turn=2, key_version=1, now=AT, draft=draft)
    (added,) = draft.checkpoints[0].rows
    stored = WorkflowRun.objects.get(pk=run.pk)
    _save_run(stored, ["status_reason"], AT)  # someone else saves the run
    counts = (StepExecution.objects.count(), AuditEvent.objects.count())

    with pytest.raises(FenceMiss):
        lease.commit(draft.checkpoints)

    assert (StepExecution.objects.count(), AuditEvent.objects.count()) == counts
    assert added.pk is None and added._state.adding
    assert lease.seen == {}  # dropped: read again before the next decision


@pytest.mark.django_db(transaction=True)
def test_an_agent_driven_to_its_end_records_each_turn_in_one_statement(postgresql, clock):
    """Three turns (one call, then two, then the final answer): every journal row is inserted by
    a checkpoint statement, none through the ORM; the calls are made once and the run completes."""
    run = run_start(workflow="test_agent", data={"tenant": "t", "order_id": "driven"})[0]
    with CaptureQueriesContext(connection) as queries:
        run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    assert receivers.counts() == {"task": 0, "message": 1, "ledger": 1, "model_call": 3}
    table = connection.ops.quote_name(StepExecution._meta.db_table)
    inserting = [q["sql"] for q in queries.captured_queries if f"INSERT INTO {table}" in q["sql"]]
    assert all(sql.startswith(("QUERY = 'WITH fenced AS", "WITH fenced AS")) for sql in inserting), inserting
    # Three turns added, two recorded with their calls: five statements, six journal rows.
    assert len(inserting) == 5
    # Turn 2's record inserts both its calls' rows.
    assert sum("resolve:2:0:credit" in sql and "resolve:2:1:notify_customer" in sql for sql in inserting) == 1
    journal = [s for s in run.steps.order_by("id") if ":" in s.step_name]
    assert [s.step_name for s in journal] == JOURNAL
    assert all(s.state == StepState.SUCCEEDED for s in journal)
    assert verify(stored_chains(run=run.workflow_id)).broken_runs == 0
    assert_invariants()
