"""Executor health: the record of live executors (register, beat, stop, prune), the embedded
loop's beats, and the stuck cause ``no_executor`` with its "why" sentence, on a driven clock."""

from __future__ import annotations

import itertools
import re
from datetime import timedelta

import pytest
from django.conf import settings
from django.test import Client
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

from recovery import counts, executors, why
from recovery.engine import loop, transitions
from recovery.engine.transitions import run_claim, run_start
from recovery.models import Executor, ExecutorMode, RunState, WorkflowRun
from tests.support.console import login

pytestmark = pytest.mark.django_db

SILENT = settings.RECOVERY_EXECUTOR_SILENT_SECONDS


def no_executor_runs(now) -> set[str]:
    return set(
        WorkflowRun.objects.filter(counts.stuck_causes(now)["no_executor"][1]).values_list("workflow_id", flat=True)
    )


def pending_run(order_id: str = "o-1") -> WorkflowRun:
    return run_start(workflow="test_orders", data={"tenant": "t", "order_id": order_id})[0]


def sentence(run: WorkflowRun, now) -> str:
    run.refresh_from_db()
    return why.why_not_moving(run, list(run.steps.all()), now=now)


# --- the record --------------------------------------------------------------------------


def test_an_executor_registers_beats_and_stops_and_a_day_silent_one_is_forgotten(clock):
    started = clock.now()
    registered = transitions.executor_register(mode=ExecutorMode.EMBEDDED, owner="host-a:4242")
    assert (registered.host, registered.pid, registered.mode) == ("host-a", 4242, "embedded")
    assert registered.started_at == registered.last_beat_at == started and registered.stopped_at is None
    assert registered.version and "test_orders" in registered.workflows
    assert executors.health(clock.now()).live

    clock.advance(SILENT)  # silent from exactly the threshold on
    assert not executors.health(clock.now()).live
    transitions.executor_beat(mode=ExecutorMode.EMBEDDED, owner="host-a:4242")
    beaten = Executor.objects.get(owner="host-a:4242")
    assert beaten.last_beat_at == clock.now() and beaten.started_at == started
    assert executors.health(clock.now()).live

    transitions.executor_stop(owner="host-a:4242")
    assert Executor.objects.get(owner="host-a:4242").stopped_at == clock.now()
    health = executors.health(clock.now())
    assert not health.live and health.last_beat_at == clock.now()  # a stopped one is not live

    # A Celery worker's first sweep registers it; the next day it is the only row left.
    clock.advance(timedelta(days=1).total_seconds() + 1)
    transitions.executor_beat(mode=ExecutorMode.CELERY, owner="worker-b:7")
    assert list(Executor.objects.values_list("owner", "mode")) == [("worker-b:7", "celery")]


def test_a_restarted_process_with_the_same_owner_starts_over(clock):
    transitions.executor_register(mode=ExecutorMode.EMBEDDED, owner="h:1")
    transitions.executor_stop(owner="h:1")
    clock.advance(60)
    again = transitions.executor_register(mode=ExecutorMode.EMBEDDED, owner="h:1")
    assert again.started_at == clock.now() and again.stopped_at is None
    assert Executor.objects.count() == 1


def test_the_embedded_loop_registers_beats_between_runs_and_marks_itself_stopped(clock, monkeypatch):
    for i in range(3):
        pending_run(f"loop-{i}")
    ticks = itertools.count(0.0, settings.RECOVERY_SWEEP_SECONDS)  # each look is a sweep interval later
    monkeypatch.setattr(loop.time, "monotonic", lambda: float(next(ticks)))
    beats = []

    def on_beat():
        beats.append(Executor.objects.get(owner="loop:1").last_beat_at)
        clock.advance(1)

    loop.run_forever(until_idle=True, owner="loop:1", on_beat=on_beat)

    # At least one beat before each claim (a backlog never silences the loop), each recorded.
    assert len(beats) >= 4 and beats == sorted(beats) and len(set(beats)) == len(beats)
    row = Executor.objects.get(owner="loop:1")
    assert row.mode == ExecutorMode.EMBEDDED and row.stopped_at is not None  # a clean exit
    assert not WorkflowRun.objects.filter(state=RunState.PENDING).exists()


def test_the_loop_stops_between_runs_when_asked_and_says_so(clock):
    pending_run("stop-1")
    loop.run_forever(owner="asked:1", should_stop=lambda: True)  # returns instead of looping forever
    row = Executor.objects.get(owner="asked:1")
    assert row.stopped_at is not None
    assert WorkflowRun.objects.get().state == RunState.PENDING  # it claimed nothing after being asked


def test_an_executor_that_crashes_says_nothing_it_goes_silent(clock, monkeypatch):
    pending_run("crash-1")

    def crash(*args, **kwargs):
        raise RuntimeError("the step machine broke")

    monkeypatch.setattr(loop, "advance_claimed", crash)
    with pytest.raises(RuntimeError):
        loop.run_forever(owner="crashed:1")
    assert Executor.objects.get(owner="crashed:1").stopped_at is None  # not a clean exit
    clock.advance(SILENT)
    assert not executors.health(clock.now()).live


# --- the cause -----------------------------------------------------------------------------


def test_a_due_run_with_no_executor_is_stuck_for_no_executor_after_the_threshold(clock):
    run = pending_run()
    assert sentence(run, clock.now()) == "due now: waiting for an executor to claim it"
    clock.advance(SILENT - 1)
    assert no_executor_runs(clock.now()) == set()  # not yet: below the threshold
    clock.advance(1)
    assert no_executor_runs(clock.now()) == {run.workflow_id}
    said = sentence(run, clock.now())
    assert said.startswith("due since ") and "no executor is running" in said and "manage.py run_executor" in said

    # An executor beating: not stuck for that cause, and the sentence is the usual one.
    transitions.executor_register(mode=ExecutorMode.EMBEDDED, owner="alive:1")
    assert no_executor_runs(clock.now()) == set()
    assert sentence(run, clock.now()) == "due now: waiting for an executor to claim it"
    # It goes silent: stuck again.
    clock.advance(SILENT)
    assert no_executor_runs(clock.now()) == {run.workflow_id}


def test_a_run_whose_lease_expired_with_no_executor_left_is_stuck_for_no_executor(clock):
    run = pending_run("leased")
    transitions.executor_register(mode=ExecutorMode.EMBEDDED, owner="dead:9")
    assert run_claim(run_pk=run.pk, owner="dead:9") is not None
    run.refresh_from_db()
    assert executors.listing(clock.now())[0]["runs_held"] == 1  # read from the lease
    clock.advance(settings.RECOVERY_LEASE_SECONDS + SILENT - 1)
    assert no_executor_runs(clock.now()) == set()  # its lease expired less than the threshold ago
    assert "waiting for another executor to take the run over" in sentence(run, clock.now())
    assert executors.listing(clock.now())[0]["runs_held"] == 0  # an expired lease holds nothing
    clock.advance(1)
    assert no_executor_runs(clock.now()) == {run.workflow_id}
    said = sentence(run, clock.now())
    assert said.startswith("the lease of dead:9 expired at ") and "no executor is running" in said


def test_runs_an_executor_holds_or_that_are_not_due_are_not_no_executor(clock):
    waiting = pending_run("later")
    WorkflowRun.objects.filter(pk=waiting.pk).update(
        state=RunState.WAITING, next_wake_at=clock.now() + timedelta(hours=1)
    )
    reserved = run_start(
        workflow="test_orders",
        data={"tenant": "t", "order_id": "reserved"},
        reserve=("seed-demo", clock.now() + timedelta(minutes=10)),
    )[0]
    clock.advance(SILENT + 60)
    assert no_executor_runs(clock.now()) == set()
    assert "no executor" not in sentence(waiting, clock.now())
    assert "no executor" not in sentence(reserved, clock.now())


def test_the_list_the_chips_the_dashboard_and_the_metrics_count_no_executor_alike(clock):
    run = pending_run("parity")
    clock.advance(SILENT)
    viewer = login("viewer")
    listed = viewer.get(reverse("console:runs") + "?stuck=no_executor")
    assert run.workflow_id in listed.text and "No executor" in listed.text
    chips = viewer.get(reverse("console:runs"), headers={"HX-Request": "true", "HX-Target": "counts"})
    chip = {c["cause"]: c["count"] for c in chips.context["stuck_counts"]}
    dashboard = viewer.get(reverse("console:dashboard")).context
    shown = {
        row["label"]: row["cells"][dashboard["workflows"].index("test_orders")][0] for row in dashboard["by_workflow"]
    }
    text = Client().get("/metrics", headers={"Authorization": "Bearer test-metrics-token-0123456789"}).text
    gauge = {
        (s.labels["workflow"], s.labels["cause"]): s.value
        for f in text_string_to_metric_families(text)
        if f.name == "recovery_stuck_runs"
        for s in f.samples
    }
    assert chip["no_executor"] == shown["No executor"] == gauge[("test_orders", "no_executor")] == 1


def test_the_shipped_prometheus_rules_alert_on_no_executor_from_the_console():
    from tests.observability.test_alert_rules import rules

    exprs = {rule["alert"]: rule["expr"] for rule in rules()}
    assert 'recovery_stuck_runs{cause="no_executor"}' in exprs["RecoveryNoExecutor"]
    named = {cause for expr in exprs.values() for cause in re.findall(r'cause="([a-z_]+)"', expr)}
    assert named <= set(counts.STUCK_LABELS)


def test_celery_beats_sweep_records_the_worker_that_ran_it(clock):
    from recovery import tasks

    tasks.sweep()  # nothing due: nothing queued
    worker = Executor.objects.get()
    assert worker.mode == ExecutorMode.CELERY and worker.owner == transitions.default_owner()
    clock.advance(SILENT)
    assert not executors.health(clock.now()).live
    tasks.sweep()
    assert executors.health(clock.now()).live and Executor.objects.count() == 1
