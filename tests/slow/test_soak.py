"""`make soak`, small: 60 invoice events through the real server, Celery workers that are
SIGKILLed every 2 s, a Redis restarted mid-run and faults armed in the simulated systems; then
one run per event, no duplicate effect, nothing stuck (bench/soak.py checks it all).

The soak makes (and drops) its own databases on the PostgreSQL server of DATABASE_URL and starts
its own Redis: no django_db mark, nothing of the test database is touched."""

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from django.db import connection

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = re.compile(
    r"soak: runs=60 completed=\d+ review=\d+ kills=[1-9]\d* faults=[1-9]\d* duplicates=0 stuck=0 .*elapsed="
)


def _skip_reason() -> str | None:
    scheme = urlsplit(os.environ.get("DATABASE_URL", "")).scheme
    if connection.vendor != "postgresql" or scheme not in ("postgres", "postgresql", "pgsql"):
        return "the soak needs PostgreSQL: set DATABASE_URL=postgres://…"
    if not shutil.which("redis-server"):
        return "the soak needs redis-server on PATH (it starts and restarts its own)"
    return None


def test_soak_60_runs_under_worker_kills_faults_and_a_broker_restart():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOAK_")}
    env.update(SOAK_RUNS="60", SOAK_KILL_EVERY="2", SOAK_TIMEOUT="150")
    soak = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "soak.py")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = soak.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        soak.send_signal(signal.SIGTERM)  # the soak stops its children and drops its databases
        try:
            out, err = soak.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            soak.kill()
            out, err = soak.communicate()
        pytest.fail(f"the soak did not finish within 240 s\n{out}\n{err[-4000:]}")
    lines = out.strip().splitlines()
    report = f"exit {soak.returncode}\n--- stdout\n{out[-6000:]}\n--- stderr (tail)\n{err[-4000:]}"
    assert soak.returncode == 0, report
    assert lines and SUMMARY.match(lines[-1]), report
