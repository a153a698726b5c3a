"""Concurrency with real processes on PostgreSQL: one event delivered 100 times from several
processes makes one run and one copy of each effect; two operators acting at once make one
transition. (SQLite serialises writers, so these skip there.)"""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.db import connections

from recovery.engine import transitions
from recovery.engine.transitions import run_start, run_version
from recovery.errors import InvalidTransition
from recovery.models import AuditEvent, RunState, StepExecution, WorkflowRun
from tests.support import receivers
from tests.support.engine import drive, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
CONSUMER = """
import os, sys, time
import django
django.setup()
from recovery.engine.executor import advance
from recovery.engine.publisher import publish_due
from recovery.engine.transitions import run_start
start_at = float(sys.argv[1])
time.sleep(max(0.0, start_at - time.time()))
for i in range(25):  # this process's share of the 100 deliveries
    run, _ = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "hundred"})
    advance(run.pk, owner=f"consumer-{os.getpid()}")
    publish_due(owner=f"consumer-{os.getpid()}")
"""


def test_one_event_delivered_100_times_from_four_processes_makes_one_of_each(postgres_only, clock):
    start_at = f"{time.time() + 2.0:.3f}"  # all four begin together
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONSUMER, start_at],
            cwd=ROOT,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    assert WorkflowRun.objects.count() == 1
    run = drive(WorkflowRun.objects.get(), clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
    assert set(StepExecution.objects.values_list("attempts", flat=True)) == {1}
    assert AuditEvent.objects.filter(action="start").count() == 1


def test_two_operators_acting_on_one_run_at_once_make_one_transition(postgres_only, clock):
    receivers.arm("task", "forbidden")
    run = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "two-ops"})[0], clock)
    version = run_version(run)
    users = [get_user_model().objects.create_user(name) for name in ("olga", "sam")]
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def act(user, action):
        try:
            barrier.wait()
            if action == "retry":
                transitions.step_retry(
                    workflow_id=run.workflow_id,
                    step_name="create_task",
                    actor=user,
                    reason="token fixed",
                    expect=version,
                )
            else:
                transitions.run_terminate(workflow_id=run.workflow_id, actor=user, reason="give up", expect=version)
            outcomes.append(action)
        except InvalidTransition as exc:
            outcomes.append(f"refused: {exc}")
        finally:
            connections.close_all()

    threads = [threading.Thread(target=act, args=(u, a)) for u, a in zip(users, ["retry", "terminate"], strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    done = [o for o in outcomes if not o.startswith("refused")]
    assert len(done) == 1 and len(outcomes) == 2, outcomes
    assert "reload" in next(o for o in outcomes if o.startswith("refused"))
    assert AuditEvent.objects.filter(run=run, action__in=["retry", "terminate"]).count() == 1
