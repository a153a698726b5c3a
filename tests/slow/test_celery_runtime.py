"""The Celery runtime with real processes: a Redis of the test's own on a free port, a
worker with beat. A run is advanced by the task enqueued on commit; a run whose message was
lost is picked up by the sweeper."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recovery.models import RunState, WorkflowRun
from tests.slow.conftest import wait_for
from tests.support import receivers
from tests.support.engine import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]


def test_celery_worker_advances_enqueued_runs_and_the_sweeper_finds_lost_ones(redis_url, tmp_path):
    celery_env = subprocess_env(RECOVERY_EXECUTOR="celery", CELERY_BROKER_URL=redis_url, RECOVERY_SWEEP_SECONDS="1")
    manage = [sys.executable, str(ROOT / "manage.py"), "start_workflow", "test_orders", "--input"]

    # Started in embedded mode: no message is ever enqueued for it, as if the broker lost it.
    lost = subprocess.run(
        [*manage, json.dumps({"tenant": "t", "order_id": "lost"})],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    queued = subprocess.run(
        [*manage, json.dumps({"tenant": "t", "order_id": "queued"})],
        env=celery_env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    queue_len = subprocess.run(["redis-cli", "-u", redis_url, "llen", "celery"], capture_output=True, text=True)
    assert queue_len.stdout.strip() == "1"  # enqueued on commit, for the celery-mode run only

    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "config",
            "worker",
            "-B",
            "-s",
            str(tmp_path / "beat-schedule"),
            "--concurrency",
            "2",
            "--loglevel",
            "INFO",
        ],
        cwd=ROOT,
        env=celery_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        done = wait_for(lambda: set(WorkflowRun.objects.values_list("state", flat=True)) == {RunState.COMPLETED})
    finally:
        worker.terminate()
        worker.wait(30)
        log.close()
    assert done, (tmp_path / "worker.log").read_text()[-3000:]
    assert {lost, queued} == set(WorkflowRun.objects.values_list("workflow_id", flat=True))
    assert receivers.counts() == {"task": 2, "message": 2, "ledger": 2, "model_call": 2}


def test_an_event_consumed_from_the_queue_twice_makes_one_run(redis_url, tmp_path):
    """The same business event delivered twice through the broker: one run, completed."""
    from config.celery import app

    celery_env = subprocess_env(RECOVERY_EXECUTOR="celery", CELERY_BROKER_URL=redis_url, RECOVERY_SWEEP_SECONDS="1")
    event = {"tenant": "t", "order_id": "queued-twice"}
    with app.connection_for_write(redis_url) as conn:
        for _ in range(2):
            app.send_task("recovery.tasks.start_run", args=["test_orders", event], connection=conn)
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "worker", "-B", "-s", str(tmp_path / "beat"), "-c", "2"],
        cwd=ROOT,
        env=celery_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        done = wait_for(lambda: list(WorkflowRun.objects.values_list("state", flat=True)) == [RunState.COMPLETED])
    finally:
        worker.terminate()
        worker.wait(30)
        log.close()
    assert done, (tmp_path / "worker.log").read_text()[-3000:]
    assert WorkflowRun.objects.get().workflow_id == "order:t:queued-twice"
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
