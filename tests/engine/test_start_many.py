"""run_start_many: many events started in a constant number of statements, each with run_start's
guarantees — a repeat gives its run, another input under the same id is a conflict for that event
alone, an invalid event is refused alone — and nothing else rolled back."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from recovery.engine import dispatch
from recovery.engine.transitions import run_start, run_start_many, runs
from recovery.models import AuditEvent, RunSearch, RunState, StepExecution, WorkflowRun
from tests.support import receivers
from tests.support.engine import drive

pytestmark = pytest.mark.django_db(transaction=True)


def event(order_id: str, text: str = "office chairs 120") -> dict:
    return {"tenant": "t", "order_id": order_id, "text": text}


def test_each_event_gets_its_own_answer_and_nothing_else_is_rolled_back(clock):
    before, _ = run_start(workflow="test_orders", data=event("old"))
    run_start(workflow="test_orders", data=event("clash", "travel 10"))
    results = run_start_many(
        workflow="test_orders",
        events=[
            event("a"),
            event("b"),
            event("a"),  # the same event again in the batch: the same run
            event("b", "travel 99"),  # the same id with another input
            {"tenant": "t"},  # does not validate
            event("old"),  # started before: its run
            event("clash"),  # started before with another input
            "not an object",
        ],
    )
    assert [(r.index, r.outcome, r.workflow_id) for r in results] == [
        (0, "created", "order:t:a"),
        (1, "created", "order:t:b"),
        (2, "existing", "order:t:a"),
        (3, "conflict", "order:t:b"),
        (4, "invalid", ""),
        (5, "existing", "order:t:old"),
        (6, "conflict", "order:t:clash"),
        (7, "invalid", ""),
    ]
    assert results[0].run.pk == results[2].run.pk and results[5].run.pk == before.pk
    assert "order_id" in results[4].error and "already exists with a different input" in results[3].error
    assert results[7].error == "workflow input must be a JSON object"

    new = WorkflowRun.objects.filter(workflow_id__in=["order:t:a", "order:t:b"])
    assert sorted(new.values_list("state", flat=True)) == [RunState.PENDING] * 2
    assert WorkflowRun.objects.count() == 4
    assert StepExecution.objects.filter(run__in=new).count() == 2 * 5
    assert AuditEvent.objects.filter(run__in=new, action="start").count() == 2
    assert RunSearch.objects.filter(run__in=new).count() == 2  # the search trigger saw them
    assert WorkflowRun.objects.get(workflow_id="order:t:b").input["text"] == "office chairs 120"
    for result in results[:2]:
        assert drive(result.run, clock).state == RunState.COMPLETED
    assert receivers.counts() == {"task": 2, "message": 2, "ledger": 2, "model_call": 2}
    call_command("verify_audit", stdout=StringIO())  # the start events written together chain as one by one


def test_a_batch_costs_as_many_statements_for_a_hundred_events_as_for_ten(clock):
    def statements(prefix: str, n: int) -> int:
        with CaptureQueriesContext(connection) as captured:
            results = run_start_many(workflow="test_orders", events=[event(f"{prefix}{i}") for i in range(n)])
        assert [r.outcome for r in results] == ["created"] * n
        return len(captured)

    assert statements("ten-", 10) == statements("hundred-", 100)


def test_under_celery_the_new_runs_are_stamped_in_one_statement_and_queued_after_commit(clock, settings, monkeypatch):
    sent = []
    monkeypatch.setitem(dispatch._senders, "run", sent.append)
    settings.RECOVERY_EXECUTOR = "celery"
    results = run_start_many(workflow="test_orders", events=[event("q1"), event("q2"), event("q1")])
    pks = [r.run.pk for r in results[:2]]
    assert sent == pks
    assert all(WorkflowRun.objects.filter(pk__in=pks).values_list("dispatched_at", flat=True))


def test_a_run_started_elsewhere_meanwhile_sends_the_batch_one_event_at_a_time(clock, monkeypatch):
    new_run, raced = runs._new_run, []

    def meanwhile(wf, ev, now, reserve):  # another process starts "b", with another input, just now
        if ev.workflow_id == "order:t:b" and not raced:
            raced.append(ev.workflow_id)
            run_start(workflow="test_orders", data=event("b", "travel 5"))
        return new_run(wf, ev, now, reserve)

    monkeypatch.setattr(runs, "_new_run", meanwhile)
    results = run_start_many(workflow="test_orders", events=[event("a"), event("b"), event("c")])
    assert [r.outcome for r in results] == ["created", "conflict", "created"]
    assert WorkflowRun.objects.count() == 3
    assert AuditEvent.objects.filter(action="start").count() == 3
