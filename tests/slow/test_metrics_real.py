"""The metrics of real processes, added up: a run of the invoice workflow is advanced by three
processes — an executor that meets a 503 and schedules a retry, one killed (SIGKILL) in the
middle of a step, and a Celery worker that takes the run over, finds the lost step absent, does
it, and meets a lost answer from the ledger — while a gunicorn with two workers serves the
simulated systems. Every process writes its counters to one PROMETHEUS_MULTIPROC_DIR; a scrape
of gunicorn's ``/metrics``, parsed with prometheus_client's parser, finds each counter at the
value the run's audit trail gives it.

No wall-clock race: the first two executors run on an engine clock pinned half an hour back, so
the dead one's lease (conftest.LEASE) had expired long before the Celery worker starts; the test
then waits for the run's own state (a hang guard, not a timing assumption)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from recovery import clock
from recovery.models import RunState, StepState, WorkflowRun
from recovery.workflow import get_workflow
from sandbox import faults
from tests.slow.conftest import manage, wait_for
from tests.support.engine import free_port, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])]

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD = 180.0  # seconds; the run normally completes in a few


@pytest.fixture
def metrics_env(tmp_path, redis_url):
    """What every process of the test shares: the multiprocess directory, the broker."""
    directory = tmp_path / "prometheus"
    directory.mkdir()
    return {
        "PROMETHEUS_MULTIPROC_DIR": str(directory),
        "CELERY_BROKER_URL": redis_url,
        "RECOVERY_METRICS_TOKEN": settings.RECOVERY_METRICS_TOKEN,
    }


@pytest.fixture
def gunicorn(tmp_path, metrics_env):
    port = free_port()
    log = open(tmp_path / "gunicorn.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "config.wsgi", "--workers", "2", "--bind", f"127.0.0.1:{port}"],
        cwd=ROOT,
        env=subprocess_env(**metrics_env),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _answers(f"{url}/healthz"), HANG_GUARD), (tmp_path / "gunicorn.log").read_text()[-3000:]
        yield url
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_scrape_adds_up_every_process_counters_exactly(tmp_path, metrics_env, gunicorn):
    env = {**metrics_env, "SANDBOX_URL": gunicorn}
    faults.clear()
    faults.set_fault("tasks", "create", "unavailable")  # the task's first attempt: 503, retried
    faults.set_fault("ledger", "post", "commit_then_drop")  # the entry commits, its answer is lost

    t0 = clock.now() - timedelta(minutes=30)
    event = {"tenant": "t1", "invoice_id": "metrics-1", "text": "Laptop stand, total EUR 240.00"}
    started = manage("start_workflow", "invoice", "--input", json.dumps(event), at=t0, **env)
    assert started.returncode == 0, started.stderr
    run = WorkflowRun.objects.get(workflow_id=started.stdout.strip())

    # 1. An executor meets the tracker's 503: the task's retry is scheduled.
    first = manage("run_executor", "--until-idle", at=t0, **env)
    assert first.returncode == 0, first.stderr
    run.refresh_from_db()
    assert run.state == RunState.WAITING, run.status_reason
    assert run.steps.get(step_name="create_approval_task").last_error_kind == "transient"

    # 2. The next executor dies in the middle of the task's attempt, holding the run.
    dead = manage(
        "run_executor",
        "--until-idle",
        at=run.next_wake_at,
        RECOVERY_FAILPOINTS="create_approval_task:before_call=crash",
        **env,
    )
    assert dead.returncode == -signal.SIGKILL, dead.stdout + dead.stderr
    run.refresh_from_db()
    assert run.state == RunState.RUNNING and run.lease_owner == dead.owner
    assert run.lease_expires_at < clock.now()  # expired long ago, on the real clock

    # 3. A Celery worker (with beat) takes it over and finishes it.
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "worker", "-B", "-s", str(tmp_path / "beat"), "-c", "2"],
        cwd=ROOT,
        env=subprocess_env(RECOVERY_EXECUTOR="celery", RECOVERY_SWEEP_SECONDS="1", **env),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        done = wait_for(lambda: WorkflowRun.objects.get(pk=run.pk).state == RunState.COMPLETED, HANG_GUARD)
    finally:
        worker.terminate()
        worker.wait(60)
        log.close()
    assert done, (tmp_path / "worker.log").read_text()[-3000:]
    counts = faults.counts()
    assert (counts["tasks"], counts["messages"], counts["ledger_entries"]) == (1, 1, 1), counts
    assert run.steps.get(step_name="post_ledger_entry").state == StepState.SUCCEEDED

    # Scraped several times, from whichever of gunicorn's workers answers: the same numbers.
    scrapes = [_counters(gunicorn) for _ in range(6)]
    assert all(s == scrapes[0] for s in scrapes), scrapes
    scraped = scrapes[0]

    expected = _from_the_audit_trail(run)
    assert {k: v for k, v in scraped.items() if k[0] in COUNTED} == expected
    # The run met each fault once: the scenario happened as arranged.
    attempts = "recovery_step_attempts_total"
    assert expected[_key(attempts, step="create_approval_task", outcome="failed", error_kind="transient")] == 1
    assert expected[_key(attempts, step="create_approval_task", outcome="unknown", error_kind="unknown_outcome")] == 1
    assert expected[_key("recovery_reconciles_total", step="create_approval_task", result="absent")] == 1
    assert expected[_key("recovery_reconciles_total", step="post_ledger_entry", result="happened")] == 1
    assert expected[_key("recovery_lease_takeovers_total")] == 1
    assert expected[_key(attempts, step="notify_approver", outcome="succeeded", error_kind="")] == 1

    # Every claim was timed from when the run was due; every call's duration was observed.
    claims = run.audit_events.filter(action__in=["claim", "lease_takeover"]).count()
    assert scraped[_key("recovery_step_schedule_to_start_seconds_count")] == claims
    timed = {dict(k[1])["step"] for k in scraped if k[0] == "recovery_step_duration_seconds_count"}
    assert timed == {s.name for s in get_workflow("invoice").steps if not s.is_wait}  # a wait calls nothing

    families = _families(gunicorn)
    runs = {s.labels["state"]: s.value for s in families["recovery_runs"].samples if s.labels["workflow"] == "invoice"}
    assert runs["completed"] == 1 and sum(runs.values()) == 1


COUNTED = {
    "recovery_step_attempts_total",
    "recovery_unknown_outcomes_total",
    "recovery_reconciles_total",
    "recovery_lease_takeovers_total",
    "recovery_policy_refusals_total",
    "recovery_operator_actions_total",
}


def _key(name: str, **labels: str) -> tuple:
    return (name, tuple(sorted({"workflow": "invoice", **labels}.items())))


def _from_the_audit_trail(run: WorkflowRun) -> dict:
    """The counters as the run's audit events say they must be (this test's own reading)."""
    found: Counter = Counter()
    attempts, reconciles = "recovery_step_attempts_total", "recovery_reconciles_total"
    for event in run.audit_events.order_by("pk"):
        step, after, action = event.step_name, event.after, event.action
        kind = after.get("error_kind", "")
        if action == "step_succeed" or (action == "outbox_delivered" and after.get("how") == "delivered"):
            found[_key(attempts, step=step, outcome="succeeded", error_kind="")] += 1
        elif action in ("step_fail", "outbox_retry", "outbox_fail"):
            outcome = "unknown" if kind == "unknown_outcome" else "failed"
            found[_key(attempts, step=step, outcome=outcome, error_kind=kind)] += 1
            if outcome == "unknown":
                found[_key("recovery_unknown_outcomes_total", step=step)] += 1
        elif action == "step_unknown":
            found[_key(attempts, step=step, outcome="unknown", error_kind=kind)] += 1
            found[_key("recovery_unknown_outcomes_total", step=step)] += 1
        elif action in ("reconciled", "outbox_delivered"):
            found[_key(reconciles, step=step, result="happened")] += 1
        elif action == "reconciled_absent":
            found[_key(reconciles, step=step, result="absent")] += 1
        elif action in ("reconcile_wait", "outbox_settle_wait"):
            found[_key(reconciles, step=step, result="wait")] += 1
        elif action == "reconcile_deferred":
            found[_key(reconciles, step=step, result="failed")] += 1
        elif action == "lease_takeover":
            found[_key("recovery_lease_takeovers_total")] += 1
        elif action == "policy_refused":
            found[_key("recovery_policy_refusals_total", rule=after["refusal"]["rule"])] += 1
    return dict(found)


def _families(url: str) -> dict:
    token = settings.RECOVERY_METRICS_TOKEN
    response = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert response.status_code == 200, response.text
    return {f.name: f for f in text_string_to_metric_families(response.text)}


def _counters(url: str) -> dict:
    """Every counter and histogram count of a scrape, by (sample name, labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in _families(url).values()
        if family.type in ("counter", "histogram")
        for s in family.samples
        if s.name.endswith("_total") or s.name.endswith("_count")
    }
