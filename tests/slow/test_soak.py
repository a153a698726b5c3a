"""`make soak`, small: 60 invoice events through the real server, Celery workers that are
SIGKILLed every 2 s, a Redis restarted mid-run, the engine's database restarted once and faults
armed in the simulated systems; then one run per event, no duplicate effect, nothing stuck
(bench/soak.py checks it all).

The soak runs the engine's database on a throwaway cluster of its own (tests/support/pgcluster.py),
makes (and drops) the simulated systems' database on the PostgreSQL server of DATABASE_URL and
starts its own Redis: no django_db mark, nothing of the test database is touched."""

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

from tests.support import pgcluster

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD = 270  # seconds; a run takes 70-125 s on a busy 2-core machine
SUMMARY = re.compile(
    r"soak: runs=60 completed=\d+ review=\d+ kills=[1-9]\d* faults=[1-9]\d* db_restarts=1 duplicates=0 stuck=0 "
    r".*elapsed="
)


def _skip_reason() -> str | None:
    scheme = urlsplit(os.environ.get("DATABASE_URL", "")).scheme
    if connection.vendor != "postgresql" or scheme not in ("postgres", "postgresql", "pgsql"):
        return "the soak needs PostgreSQL: set DATABASE_URL=postgres://…"
    if not shutil.which("redis-server"):
        return "the soak needs redis-server on PATH (it starts and restarts its own)"
    try:
        pgcluster.check_available()
    except pgcluster.ClusterUnavailable as exc:
        return f"the soak needs PostgreSQL's server binaries (the engine's own cluster, restarted): {exc}"
    return None


def test_soak_60_runs_under_worker_kills_faults_a_broker_and_a_database_restart():
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
        # A hang guard above set-up (now with initdb and the start of the soak's own cluster),
        # 20 s of load, SOAK_TIMEOUT and the teardown: a slow soak reports its own violations.
        out, err = soak.communicate(timeout=HANG_GUARD)
    except subprocess.TimeoutExpired:
        soak.send_signal(signal.SIGTERM)  # the soak stops its children, its cluster, drops its database
        try:
            out, err = soak.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            soak.kill()
            out, err = soak.communicate()
        pytest.fail(f"the soak did not finish within {HANG_GUARD} s\n{out}\n{err[-4000:]}")
    lines = out.strip().splitlines()
    report = f"exit {soak.returncode}\n--- stdout\n{out[-6000:]}\n--- stderr (tail)\n{err[-4000:]}"
    assert soak.returncode == 0, report
    assert lines and SUMMARY.match(lines[-1]), report
