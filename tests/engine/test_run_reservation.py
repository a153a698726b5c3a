"""A run started for one executor (``run_start(reserve=(owner, until))``): no other executor,
nor the sweeper's dispatch, takes it before ``until`` unless it is released; the owner claims it
as any run. On both claim paths (PostgreSQL's one statement, and the transaction)."""

from datetime import timedelta

import pytest
from django.db import connection

from recovery.engine import publisher, transitions
from recovery.engine.executor import advance
from recovery.engine.transitions import leases
from recovery.models import AuditEvent, OutboxMessage, RunState, WorkflowRun

pytestmark = pytest.mark.django_db

EVENT = {"tenant": "t", "order_id": "o-1", "text": "office chairs 120"}


@pytest.fixture(params=["transaction", "one_statement"])
def claim_path(request, monkeypatch):
    if request.param == "one_statement":
        if connection.vendor != "postgresql":
            pytest.skip("the one-statement claim is PostgreSQL's (set DATABASE_URL=postgres://…)")
        monkeypatch.setattr(leases, "_claim_in_transaction", leases._claim_in_one_statement)
    else:
        monkeypatch.setattr(leases, "_claim_in_one_statement", leases._claim_in_transaction)
    return request.param


def reserved(clock, minutes: float = 10) -> WorkflowRun:
    run, created = transitions.run_start(
        workflow="test_orders", data=EVENT, reserve=("seed", clock.now() + timedelta(minutes=minutes))
    )
    assert created and (run.reserved_for, run.state) == ("seed", RunState.PENDING)
    return run


def test_another_executor_and_the_dispatch_leave_a_reserved_run_alone(clock, claim_path):
    run = reserved(clock)
    assert transitions.run_claim_next(owner="intruder") is None
    assert transitions.run_claim(run_pk=run.pk, owner="intruder") is None
    assert advance(run.pk, owner="intruder") is None
    assert transitions.runs_dispatch(limit=10) == []
    run.refresh_from_db()
    assert (run.state, run.lease_owner, run.lease_generation) == (RunState.PENDING, "", 0)
    assert list(AuditEvent.objects.filter(run=run).values_list("action", flat=True)) == ["start"]


def test_the_owner_claims_and_advances_it_as_any_run(clock, claim_path):
    run = reserved(clock)
    assert transitions.run_claim_next(owner="seed").run_pk == run.pk


def test_the_owner_advances_it_to_the_end(clock, claim_path):
    run = reserved(clock)
    assert advance(run.pk, owner="seed") == RunState.COMPLETED


def test_it_is_everyones_once_released_or_once_the_reservation_ends(clock, claim_path):
    run = reserved(clock, minutes=10)
    assert transitions.runs_release_reservation(run_pks=[run.pk], owner="someone else") == 0
    assert transitions.run_claim_next(owner="intruder") is None
    assert transitions.runs_release_reservation(run_pks=[run.pk], owner="seed") == 1
    assert transitions.run_claim_next(owner="other").run_pk == run.pk

    late = transitions.run_start(
        workflow="test_orders", data={**EVENT, "order_id": "o-2"}, reserve=("seed", clock.now() + timedelta(minutes=1))
    )[0]
    assert transitions.run_claim(run_pk=late.pk, owner="other") is None
    clock.advance(60)  # a seed that died: its reservation ends, and the run is not stranded
    assert transitions.run_claim(run_pk=late.pk, owner="other").run_pk == late.pk


def test_starting_an_existing_event_again_does_not_reserve_it(clock):
    first, _ = transitions.run_start(workflow="test_orders", data=EVENT)
    again, created = transitions.run_start(
        workflow="test_orders", data=EVENT, reserve=("seed", clock.now() + timedelta(minutes=10))
    )
    assert not created and again.pk == first.pk
    assert WorkflowRun.objects.get(pk=first.pk).reserved_for is None


def test_a_reserved_runs_messages_are_delivered_by_its_owner_only(clock):
    run = reserved(clock)
    # The row as the step's enqueue writes it (the claim query is what is under test here).
    message = OutboxMessage.objects.create(
        run=run,
        step_name="notify",
        idempotency_key="k" * 64,
        payload={},
        created_at=clock.now(),
        updated_at=clock.now(),
    )
    assert transitions.outbox_claim(pk=message.pk, owner="intruder") is None
    assert transitions.outbox_dispatch(limit=10) == []
    assert publisher.due_outbox_ids() == []
    assert transitions.outbox_claim(pk=message.pk, owner="seed").owner == "seed"

    transitions.runs_release_reservation(run_pks=[run.pk], owner="seed")
    clock.advance(3600)  # the owner's claim expired
    assert transitions.outbox_claim(pk=message.pk, owner="other").owner == "other"
