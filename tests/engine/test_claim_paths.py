"""One claim, two paths: PostgreSQL claims in one statement (storage.claim), every database can
claim in a transaction (leases._claim_in_transaction). Both read the state switch from the
transitions' table; here the same claims run on both paths, on twin runs, and the rows they
leave (run, steps, audit event, history) are compared field by field."""

import json
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import connection

from recovery.engine import transitions
from recovery.engine.executor import advance
from recovery.engine.transitions.leases import _claim_in_one_statement, _claim_in_transaction
from recovery.models import AuditEvent, RunState, WorkflowRun

pytestmark = pytest.mark.django_db

# Fields that differ between twins by construction: their own ids, and what is derived from
# the event (the workflow id, the keys, the hash chain).
RUN_OWN = {"id", "workflow_id", "input", "input_hash"}
STEP_OWN = {"id", "run", "idempotency_key", "intent", "request_hash", "remote_ref", "result"}
AUDIT_OWN = {"id", "run", "prev_hash", "hash"}


@pytest.fixture(autouse=True)
def postgresql():
    if connection.vendor != "postgresql":
        pytest.skip("the one-statement claim is PostgreSQL's (set DATABASE_URL=postgres://…)")


def fields(obj, own: set[str]) -> dict[str, Any]:
    return {f.name: getattr(obj, f.attname) for f in obj._meta.concrete_fields if f.name not in own}


def pending(order: str, clock) -> WorkflowRun:
    return transitions.run_start(workflow="test_orders", data={"tenant": "t", "order_id": order})[0]


def lease_expired(order: str, clock) -> WorkflowRun:
    run = pending(order, clock)
    transitions.run_claim(run_pk=run.pk, owner="lost-executor")
    return run


def waiting(order: str, clock) -> WorkflowRun:
    run = pending(order, clock)
    lease = transitions.run_claim(run_pk=run.pk, owner="first")
    transitions.run_wait(lease=lease, wake_at=clock.now(), reason="retrying create_task")
    return run


def compensating(order: str, clock) -> WorkflowRun:
    run = pending(order, clock)
    advance(run.pk)
    supervisor = get_user_model().objects.get_or_create(username="sam")[0]
    supervisor.groups.add(Group.objects.get_or_create(name="supervisor")[0])
    transitions.run_compensate(workflow_id=run.workflow_id, actor=supervisor, reason="vendor cancelled the order")
    return run


@pytest.mark.parametrize(
    "prepare,expected",
    [
        (pending, ("claim", RunState.RUNNING)),
        (lease_expired, ("lease_takeover", RunState.RUNNING)),
        (waiting, ("claim", RunState.RUNNING)),
        (compensating, ("claim", RunState.COMPENSATING)),
    ],
)
def test_both_claim_paths_leave_the_same_rows(clock, prepare, expected):
    one, other = prepare("twin-a", clock), prepare("twin-b", clock)
    clock.advance(3600)  # past every lease and wake-up time
    events = AuditEvent.objects.count()
    steps_before = [[fields(s, {"run"}) for s in r.steps.order_by("position")] for r in (one, other)]

    leases = [
        _claim_in_one_statement("executor-2", clock.now(), one.pk),
        _claim_in_transaction("executor-2", clock.now(), other.pk),
    ]

    runs = [WorkflowRun.objects.get(pk=r.pk) for r in (one, other)]
    action, state = expected
    assert [r.state for r in runs] == [state, state]
    assert fields(runs[0], RUN_OWN) == fields(runs[1], RUN_OWN)
    # A claim leaves the steps as they were, on either path.
    assert [[fields(s, {"run"}) for s in r.steps.order_by("position")] for r in runs] == steps_before
    steps = [[fields(s, STEP_OWN) for s in r.steps.order_by("position")] for r in runs]
    assert steps[0] == steps[1] and steps[0]
    audits = [r.audit_events.get(action=action, id__gt=0, at=clock.now()) for r in runs]
    assert fields(audits[0], AUDIT_OWN) == fields(audits[1], AUDIT_OWN)
    assert AuditEvent.objects.count() == events + 2  # one event per claim, nothing else
    assert runs[0].history.count() == runs[1].history.count()

    a, b = leases
    assert (a.owner, a.generation, a.taken_over) == (b.owner, b.generation, b.taken_over)
    assert a.taken_over == (action == "lease_takeover")
    assert fields(a.seen["run"], RUN_OWN) == fields(b.seen["run"], RUN_OWN) == fields(runs[0], RUN_OWN)
    assert [fields(s, STEP_OWN) for s in a.seen["steps"].values()] == steps[0]
    assert [fields(s, STEP_OWN) for s in b.seen["steps"].values()] == steps[1]


def test_a_run_no_claim_may_take_is_left_alone_by_both_paths(clock):
    done = [pending(order, clock) for order in ("done-a", "done-b")]
    for run in done:
        advance(run.pk)
    events = AuditEvent.objects.count()
    assert _claim_in_one_statement("x", clock.now(), done[0].pk) is None
    assert _claim_in_transaction("x", clock.now(), done[1].pk) is None
    assert AuditEvent.objects.count() == events
    assert {r.state for r in WorkflowRun.objects.all()} == {RunState.COMPLETED}


def test_the_claims_generic_plan_walks_only_the_runs_in_progress(clock):
    """A prepared claim runs on a generic plan after its fifth execution: its run states must be
    literals in the statement, or PostgreSQL cannot match an index on the runs in progress and
    walks every finished run instead (33-75 ms a claim at 100,000 of them, measured). Which index
    it takes is the planner's choice; what is asserted is the walk: the rows the plan read,
    executed, beside finished runs, runs waiting for days and a backlog of due ones."""
    from recovery import registry
    from recovery.engine.transitions.leases import _PICKED, _pick_params, _pick_sql

    now = clock.now()
    finished = 3000
    many(finished, "done", now, state=RunState.COMPLETED)
    # Runs at a durable wait, due in three days: as many again, older than the due run. The claim
    # must not walk them either (issue 38: 100,000 waiting runs cost every claim 100 ms).
    many(finished, "waits", now, state=RunState.WAITING, next_wake_at=now + timedelta(days=3))
    due = pending("due", clock)
    # And a backlog of newer due runs: the claim takes the oldest without reading them all.
    many(BACKLOG, "backlog", now, state=RunState.PENDING)
    sql, params = _pick_sql(connection.vendor, False, registry.deployed(), _PICKED)
    numbered = sql
    for n in range(1, len(params) + 1):
        numbered = numbered.replace("%s", f"${n}", 1)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE recovery_workflowrun")
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        try:
            cursor.execute(f"PREPARE pick_test AS {numbered}")
            args = ", ".join(["%s"] * len(params))
            cursor.execute(
                f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE pick_test({args})", _pick_params(params, now, None, "me")
            )
            (explained,) = cursor.fetchone()
        finally:
            cursor.execute("DEALLOCATE ALL")
            cursor.execute("RESET plan_cache_mode")
    explained = json.loads(explained) if isinstance(explained, str) else explained
    root = explained[0]["Plan"]
    assert root["Actual Rows"] == 1, root  # it picked the oldest due run
    walked = _rows_read(root, "recovery_workflowrun")
    beside = f"beside {finished} finished, as many waiting and {BACKLOG} due"
    assert walked <= 10, f"{walked} runs read to claim 1 {beside}: {root}"
    assert WorkflowRun.objects.filter(pk=due.pk, state=RunState.PENDING).exists()


BACKLOG = 400


def many(n: int, prefix: str, now, **fields) -> None:
    """``n`` runs of test_orders written at once, in the state ``fields`` give (no steps)."""
    WorkflowRun.objects.bulk_create(
        WorkflowRun(
            workflow_id=f"{prefix}:{i}",
            workflow_name="test_orders",
            workflow_version=1,
            input={},
            input_hash="",
            created_at=now,
            updated_at=now,
            **fields,
        )
        for i in range(n)
    )


def _rows_read(node: dict, table: str) -> int:
    """Live rows of ``table`` a plan's scans of it read (kept, and removed by their filters), every
    loop. A bitmap index scan is not counted itself: its entries include rows other tests rolled
    back, which its heap scan then skips (CI's shared test database); the heap scan counts what
    it read."""
    read = 0
    if node.get("Relation Name") == table and "Scan" in node["Node Type"]:
        removed = node.get("Rows Removed by Filter", 0) + node.get("Rows Removed by Index Recheck", 0)
        read = (node["Actual Rows"] + removed) * node.get("Actual Loops", 1)
    return read + sum(_rows_read(child, table) for child in node.get("Plans", []))
