"""The executor's copy of a claimed run (Lease.seen): it saves reads and statements while the
executor is the run's only writer, and is dropped the moment anyone else saves the run."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from recovery.engine import transitions
from recovery.engine.audit.chain import stored_chains, verify
from recovery.engine.executor import advance
from recovery.engine.transitions import _core, leased_run, run_claim, run_start
from recovery.engine.transitions._core import _save_run
from recovery.errors import LeaseLost
from recovery.models import AuditEvent, RunState, StepExecution, StepState, WorkflowRun
from recovery.workflow import Outcome
from tests.support import receivers

pytestmark = pytest.mark.django_db

EVENT = {"tenant": "t", "order_id": "copy-1"}


def verb(sql: str) -> str:
    """A logged statement's first word. A prepared statement (the executor's, on PostgreSQL) is
    logged as ``QUERY = '<sql>' - PARAMS = (…)``: Django shows the SQL of a query bound on the
    server that way."""
    return sql.removeprefix("QUERY = '").removeprefix('QUERY = "').split()[0].upper()


def start() -> WorkflowRun:
    return run_start(workflow="test_orders", data=EVENT)[0]


def test_a_step_checkpoints_in_two_writes_and_reads_nothing_in_between():
    """On PostgreSQL each checkpoint is one statement (its own transaction); elsewhere one
    transaction of three: the fenced UPDATE of the run, the step's UPDATE, the audit INSERT."""
    run = start()
    lease = run_claim(run_pk=run.pk)
    assert leased_run(lease) is not None  # the claim's copy: no query
    with CaptureQueriesContext(connection) as queries:
        transitions.step_begin(lease=lease, step_name="read", intent={}, request_hash="h")
        transitions.step_succeed(lease=lease, step_name="read", outcome=Outcome(result={"text": "x"}))
        _, steps = leased_run(lease)
    statements = [verb(q["sql"]) for q in queries.captured_queries]
    per_checkpoint = ["WITH"] if connection.vendor == "postgresql" else ["UPDATE", "UPDATE", "INSERT"]
    writes = [s for s in statements if s not in ("BEGIN", "SAVEPOINT", "RELEASE", "COMMIT")]
    assert writes == per_checkpoint * 2, queries.captured_queries
    assert steps[0].state == StepState.SUCCEEDED and steps[0].result == {"text": "x"}
    run.refresh_from_db()
    assert run.lease_expires_at is not None and run.current_step == "read"


def written_checkpoints(queries) -> list[int]:
    """For each checkpoint statement captured, how many audit events it wrote (its VALUES rows)."""
    return [q["sql"].count("(CAST(%s") for q in queries.captured_queries if "WITH" in verb(q["sql"])]


def test_checkpoints_decided_on_one_draft_are_written_as_one_write_and_the_copy_changes_only_after_it():
    """``Lease.commit`` of a list: on PostgreSQL one statement (the run, each step once, every
    audit event in order); elsewhere one transaction. Until it is written, the copy is what the
    executor last wrote."""
    run = start()
    lease = run_claim(run_pk=run.pk)
    copy = lease.seen["steps"]["read"]
    draft = transitions.Draft.read(lease)
    transitions.step_begin(lease=lease, step_name="read", intent={}, request_hash="h", draft=draft)
    transitions.step_succeed(lease=lease, step_name="read", outcome=Outcome(result={"text": "x"}), draft=draft)
    assert lease.seen["steps"]["read"] is copy and copy.state == StepState.PENDING  # decided, not written
    assert run.steps.get(step_name="read").state == StepState.PENDING

    with CaptureQueriesContext(connection) as queries:
        lease.commit(draft.checkpoints)

    if connection.vendor == "postgresql":
        assert written_checkpoints(queries) == [2]
    read = run.steps.get(step_name="read")
    assert (read.state, read.attempts, read.result) == (StepState.SUCCEEDED, 1, {"text": "x"})
    assert leased_run(lease)[1][0].state == StepState.SUCCEEDED  # now the copy
    actions = list(AuditEvent.objects.filter(run=run).order_by("id").values_list("action", "step_name"))
    assert actions[-2:] == [("step_begin", "read"), ("step_succeed", "read")]
    assert verify(stored_chains(run=run.workflow_id)).broken_runs == 0


def test_a_fence_miss_decides_again_on_the_fresh_rows_and_writes_once(clock, monkeypatch):
    """Someone else saves the run between the executor's decision and its write: the write
    matches nothing, the run is read again under its lock and the transition decided again on
    it — one write, one audit event, and the other writer's change stands."""
    run = start()
    lease = run_claim(run_pk=run.pk)
    reads, decisions = [], []
    real_read, real_decide = transitions.Draft.read, _core._decide

    def read(lease, *, locked=False):
        draft = real_read(lease, locked=locked)
        reads.append(locked)
        if not locked:  # after the executor has read its draft: an operator's note on the run
            other = WorkflowRun.objects.get(pk=run.pk)
            other.incident = "ledger answered 502 at 03:12"
            _save_run(other, ["incident"], clock.now())
        return draft

    def decide(draft, action, now, body, **kwargs):
        decisions.append(draft.revision)
        return real_decide(draft, action, now, body, **kwargs)

    monkeypatch.setattr(transitions.Draft, "read", staticmethod(read))
    monkeypatch.setattr(_core, "_decide", decide)
    before = AuditEvent.objects.filter(run=run).count()

    step = transitions.step_begin(lease=lease, step_name="read", intent={}, request_hash="h")

    assert reads == [False, True]  # the copy, then the fresh rows under the lock
    assert len(decisions) == 2 and decisions[1] == decisions[0] + 1  # decided again on the other's revision
    assert step.state == StepState.RUNNING and step.attempts == 1
    assert AuditEvent.objects.filter(run=run).count() == before + 1  # written once
    fresh = WorkflowRun.objects.get(pk=run.pk)
    assert fresh.incident == "ledger answered 502 at 03:12"  # not overwritten by the out-of-date copy
    assert run.steps.get(step_name="read").attempts == 1
    assert leased_run(lease)[0].revision == fresh.revision  # the copy is the rows as written


def test_a_run_saved_by_someone_else_is_read_again_before_the_next_checkpoint(clock):
    run = start()
    lease = run_claim(run_pk=run.pk)
    # Someone else (here: a write the executor did not make) changes a step and saves the run.
    step = run.steps.get(step_name="read")
    step.result = {"text": "changed elsewhere"}
    step.save(update_fields=["result"])
    other = WorkflowRun.objects.get(pk=run.pk)
    _save_run(other, [], clock.now())

    transitions.step_begin(lease=lease, step_name="read", intent={}, request_hash="h")

    _, steps = leased_run(lease)
    assert steps[0].result == {"text": "changed elsewhere"}  # not the claim's copy
    assert steps[0].state == StepState.RUNNING


def test_a_terminated_run_fences_out_its_executor_even_with_a_current_copy(clock):
    run = start()
    lease = run_claim(run_pk=run.pk)
    transitions.run_terminate(workflow_id=run.workflow_id, reason="duplicate invoice", actor=None)
    audit = AuditEvent.objects.count()

    with pytest.raises(LeaseLost):
        transitions.step_begin(lease=lease, step_name="read", intent={}, request_hash="h")

    assert AuditEvent.objects.count() == audit  # nothing written
    assert WorkflowRun.objects.get(pk=run.pk).state == RunState.TERMINATED
    assert leased_run(lease) is None


def test_advance_returns_the_state_it_left_the_run_in():
    run = start()
    assert advance(run.pk) == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}


def test_a_claim_and_a_takeover_are_audited_alike_on_every_database(clock):
    """PostgreSQL claims in one statement (rows.claim), other databases in a transaction
    (transitions.leases._claim): the same rows either way."""
    run = start()
    first = run_claim(run_pk=run.pk, owner="first")
    clock.advance(60)  # its lease expires: the next claim takes the run over
    second = run_claim(run_pk=run.pk, owner="second")

    assert (first.generation, second.generation) == (1, 2)
    claim, takeover = run.audit_events.filter(action__in=["claim", "lease_takeover"]).order_by("id")
    assert (claim.action, claim.actor, claim.before, claim.after) == (
        "claim",
        "executor",
        {"run": "pending"},
        {"run": "running", "lease_owner": "first"},
    )
    assert (takeover.action, takeover.before, takeover.after) == (
        "lease_takeover",
        {"run": "running", "lease_owner": "first"},
        {"run": "running", "lease_owner": "second"},
    )
    assert takeover.at == clock.now()
    run.refresh_from_db()
    assert (run.state, run.lease_owner, run.lease_generation) == ("running", "second", 2)
    assert run.lease_expires_at > clock.now() and run.next_wake_at is None and run.dispatched_at is None
    _, steps = leased_run(second)
    assert [s.step_name for s in steps] == ["read", "decide", "create_task", "notify", "post_entry"]


def test_a_transition_refused_by_an_out_of_date_copy_is_decided_on_the_fresh_rows(clock):
    run = start()
    lease = run_claim(run_pk=run.pk)
    _, steps = leased_run(lease)
    steps[0].state = StepState.SUCCEEDED  # the copy says "read" is done; the database says pending
    _save_run(WorkflowRun.objects.get(pk=run.pk), [], clock.now())  # someone else saved the run

    step = transitions.step_begin(lease=lease, step_name="read", intent={}, request_hash="h")

    assert step.state == StepState.RUNNING and step.attempts == 1
    assert run.steps.get(step_name="read").state == StepState.RUNNING


@pytest.fixture
def postgresql():
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are PostgreSQL's (set DATABASE_URL=postgres://…)")


def _prepared_statements() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0].lstrip() for row in cursor.fetchall()]


@pytest.mark.django_db(transaction=True)
def test_on_postgresql_the_claim_and_the_checkpoints_run_as_prepared_statements(postgresql):
    """Planning a claim or a checkpoint costs PostgreSQL about as much as running it: the
    executor's connection prepares each of its statements once."""
    connection.close()  # a connection of this test's own: nothing prepared yet
    advance(start().pk)
    prepared = _prepared_statements()
    assert any(s.startswith("WITH picked AS") for s in prepared), prepared  # the claim
    assert any(s.startswith("WITH fenced AS") for s in prepared), prepared  # a checkpoint
    assert all("$1" in s for s in prepared)  # bound on the server, not a copy per value


@pytest.mark.django_db(transaction=True)
def test_prepared_statements_can_be_turned_off_for_a_connection_pooler(postgresql, settings):
    settings.RECOVERY_PREPARED_STATEMENTS = False
    connection.close()
    assert advance(start().pk) is not None
    assert _prepared_statements() == []


@pytest.mark.django_db(databases=[])  # no database: any query fails the test
def test_a_transition_is_a_value_decided_without_a_database(clock):
    """An executor transition decided on a draft reads and writes nothing: its checkpoint holds
    the fields it changes, its fence and its audit event."""
    run = WorkflowRun(
        pk=7,
        workflow_id="orders:t:1",
        workflow_name="test_orders",
        state=RunState.RUNNING,
        lease_generation=3,
        revision=11,
        input={},
    )
    read = StepExecution(pk=70, run=run, step_name="read", position=0, idempotency_key="k", updated_at=clock.now())
    lease = transitions.Lease(run_pk=7, owner="x", generation=3)
    draft = transitions.Draft(lease, run, {"read": read})

    step = transitions.step_begin(lease=lease, step_name="read", intent={"a": 1}, request_hash="h", draft=draft)

    (checkpoint,) = draft.checkpoints
    assert checkpoint.fence == {"lease_generation": 3, "revision": 11, "state": transitions.LEASED_RUN_STATES}
    assert checkpoint.run == {
        "updated_at": clock.now(),
        "lease_expires_at": checkpoint.run["lease_expires_at"],
        "current_step": "read",
    }
    assert checkpoint.steps["read"]["state"] == StepState.RUNNING and checkpoint.steps["read"]["attempts"] == 1
    assert checkpoint.event["action"] == "step_begin" and checkpoint.event["before"]["step"] == StepState.PENDING
    assert step is not read and read.state == StepState.PENDING  # the copy is untouched


def test_a_new_step_is_the_row_the_orm_s_constructor_gives_with_its_own_mutable_defaults():
    from recovery.engine.transitions.runs import new_step
    from recovery.registry import get_workflow
    from recovery.workflow import idempotency_key

    run = start()
    spec = get_workflow("test_orders").steps[1]
    made, other = new_step(run, spec, run.created_at), new_step(run, spec, run.created_at)
    orm = StepExecution(
        run=run,
        step_name=spec.name,
        position=spec.position,
        key_version=spec.key_version,
        idempotency_key=idempotency_key(run.workflow_id, spec.name, spec.key_version),
        updated_at=run.created_at,
    )
    fields = [f.attname for f in StepExecution._meta.concrete_fields]
    assert [getattr(made, f) for f in fields] == [getattr(orm, f) for f in fields]
    assert made.run is run and made._state.adding and made._state.db is None
    made.overrides.append("x")  # a default made anew for each row, never shared
    assert other.overrides == [] and StepExecution().overrides == []
