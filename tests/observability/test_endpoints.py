"""/metrics (behind its token), /healthz, /readyz and their commands."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from recovery import counts
from recovery.console import selectors
from recovery.engine.loop import run_forever
from recovery.engine.transitions import run_start, sweeper_beat
from recovery.models import OutboxMessage, OutboxState, RunState, SweeperBeat, WorkflowRun
from recovery.observability import health
from tests.support import receivers
from tests.support.engine import drive, free_port

pytestmark = pytest.mark.django_db

TOKEN = "test-metrics-token-0123456789"  # config/test_settings.py


def scrape(client: Client | None = None) -> dict:
    response = (client or Client()).get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    return {f.name: f for f in text_string_to_metric_families(response.content.decode())}


def value(families: dict, name: str, **labels: str) -> float:
    family = families[name]
    matching = [s.value for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matching) == 1, f"{name}{labels}: {matching}"
    return matching[0]


def test_metrics_report_runs_by_workflow_and_state_and_stuck_runs_by_cause(clock):
    drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "ok"})[0], clock)
    receivers.arm("ledger", "unavailable", times=10)
    stuck = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "stuck"})[0], clock)
    assert stuck.state == RunState.NEEDS_REVIEW

    families = scrape()
    assert value(families, "recovery_runs", workflow="test_orders", state="completed") == 1
    assert value(families, "recovery_runs", workflow="test_orders", state="needs_review") == 1
    assert value(families, "recovery_runs", workflow="test_orders", state="failed") == 0
    assert value(families, "recovery_runs", workflow="test_local", state="completed") == 0
    assert value(families, "recovery_stuck_runs", workflow="test_orders", cause="needs_review") == 1
    assert value(families, "recovery_stuck_runs", workflow="test_orders", cause="exhausted") == 1
    assert value(families, "recovery_stuck_runs", workflow="test_orders", cause="unknown") == 0
    assert value(families, "recovery_outbox_oldest_undelivered_seconds") == 0
    # The console's chips count the same runs (one source: recovery.counts).
    chips = {c["cause"]: c["count"] for c in counts.stuck_counts(now=clock.now())}
    assert chips["exhausted"] == 1 and chips["needs_review"] == 1


def test_an_undelivered_message_ages_in_the_gauge(clock):
    start = clock.now()
    run, _ = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "box"})
    OutboxMessage.objects.create(
        run=run, step_name="notify", idempotency_key="box-1", payload={}, created_at=start, updated_at=start
    )
    clock.advance(90)
    assert value(scrape(), "recovery_outbox_oldest_undelivered_seconds") == 90
    OutboxMessage.objects.update(state=OutboxState.DELIVERED)
    assert value(scrape(), "recovery_outbox_oldest_undelivered_seconds") == 0


def test_metrics_are_off_without_a_token_and_refuse_a_wrong_one(settings):
    client = Client()
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 403
    assert client.get("/metrics", headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
    settings.RECOVERY_METRICS_TOKEN = ""
    off = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert off.status_code == 404 and b"RECOVERY_METRICS_TOKEN" in off.content


def test_the_metrics_command_prints_what_the_endpoint_serves(clock, capsys):
    drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "cmd"})[0], clock)
    call_command("metrics")
    families = {f.name: f for f in text_string_to_metric_families(capsys.readouterr().out)}
    assert value(families, "recovery_runs", workflow="test_orders", state="completed") == 1


def test_healthz_answers_without_a_login():
    response = Client().get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_readyz_needs_a_recent_sweeper_beat(clock, settings):
    client = Client()
    first = client.get("/readyz")
    assert first.status_code == 503
    assert first.json()["checks"]["sweeper"] == {
        "ok": False,
        "detail": "no sweeper has run yet (celery beat, or manage.py run_executor)",
    }
    assert first.json()["checks"]["database"]["ok"] and first.json()["checks"]["migrations"]["ok"]

    sweeper_beat(name="embedded executor")
    clock.advance(10)
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.json()
    assert ready.json()["checks"]["sweeper"] == {"ok": True, "detail": "embedded executor swept 10 s ago"}

    clock.advance(settings.RECOVERY_READY_BEAT_SECONDS)
    assert client.get("/readyz").status_code == 503


def test_readyz_checks_the_broker_when_celery_advances_runs(clock, settings):
    sweeper_beat(name="celery beat")
    settings.RECOVERY_EXECUTOR = "celery"
    report = health.ready()  # the machine's broker (CELERY_BROKER_URL) answers
    assert report["checks"]["broker"] == {"ok": True, "detail": "answers"} and report["status"] == "ok"
    settings.CELERY_BROKER_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    report = health.ready()
    assert report["status"] == "fail"
    assert report["checks"]["broker"]["ok"] is False
    assert "127.0.0.1" not in json.dumps(report)  # nothing about where it is


def test_check_health_exits_1_with_one_line_when_not_ready(clock, capsys):
    with pytest.raises(SystemExit) as exit_:
        call_command("check_health")
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith("not ready: sweeper: no sweeper has run yet")

    sweeper_beat(name="embedded executor", now=clock.now() - timedelta(seconds=5))
    call_command("check_health")
    assert json.loads(capsys.readouterr().out)["status"] == "ok"


def test_the_embedded_executor_beats_while_it_sweeps(clock):
    run_forever(until_idle=True, owner="beater")
    beat = SweeperBeat.objects.get()
    assert (beat.name, beat.by, beat.at) == ("embedded executor", "beater", clock.now())


def test_readyz_says_the_migrations_are_missing_before_it_looks_for_the_sweeper(clock, monkeypatch):
    """A deployment not yet migrated: 503 with what to do, not a 500 from the beat's missing table."""
    from django.db.migrations.executor import MigrationExecutor

    monkeypatch.setattr(health, "_migrated", False)
    monkeypatch.setattr(MigrationExecutor, "migration_plan", lambda self, targets: [("recovery", "0025")])
    response = Client().get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"] == {
        "database": {"ok": True, "detail": "answers"},
        "migrations": {"ok": False, "detail": "1 migration(s) not applied: run manage.py migrate"},
    }


def test_runs_of_a_workflow_no_longer_registered_still_count(clock):
    """A deploy renamed or removed a workflow: its runs keep their old name, and a stuck one must
    still show in the gauges (an alert on recovery_stuck_runs is how an operator hears of it)."""
    receivers.arm("ledger", "unavailable", times=10)
    stuck = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "old"})[0], clock)
    assert stuck.state == RunState.NEEDS_REVIEW
    WorkflowRun.objects.filter(pk=stuck.pk).update(workflow_name="test_orders_retired")  # its code is gone

    families = scrape()
    runs = {
        s.labels["state"]: s.value
        for s in families["recovery_runs"].samples
        if s.labels["workflow"] == "test_orders_retired"
    }
    stuck_runs = {
        s.labels["cause"]: s.value
        for s in families["recovery_stuck_runs"].samples
        if s.labels["workflow"] == "test_orders_retired"
    }
    assert runs == {state.value: int(state == RunState.NEEDS_REVIEW) for state in RunState}
    assert stuck_runs == {cause: int(cause in ("needs_review", "exhausted")) for cause in counts.STUCK_LABELS}
    # Its old name no longer counts it; registered workflows without runs keep their series, at 0.
    assert value(families, "recovery_runs", workflow="test_orders", state="needs_review") == 0
    assert value(families, "recovery_runs", workflow="test_local", state="completed") == 0
    names = selectors.workflow_names()
    assert names[-1] == "test_orders_retired" and "test_orders" in names[:-1]
    assert len(names) == len(set(names))
