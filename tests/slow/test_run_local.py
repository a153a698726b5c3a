"""`make run`'s supervisor (`manage.py run_local`) with real processes: an executor that dies is
reported loudly on stderr, with how it ended, and a new one registers; SIGTERM stops both, exit 0,
without "Segmentation fault". Waits are hang guards (generous), never timing assumptions."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from recovery.models import Executor, ExecutorMode
from tests.slow.conftest import MANAGE, wait_for
from tests.support.engine import free_port, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
GUARD = 60.0


def live_embedded() -> list[Executor]:
    return list(Executor.objects.filter(mode=ExecutorMode.EMBEDDED, stopped_at__isnull=True).order_by("started_at"))


@pytest.fixture
def supervisor(tmp_path):
    err, out = tmp_path / "run_local.err", tmp_path / "run_local.out"
    with err.open("w") as e, out.open("w") as o:
        proc = subprocess.Popen(
            [sys.executable, MANAGE, "run_local", "--addr", f"127.0.0.1:{free_port()}"],
            env=subprocess_env(),
            stdout=o,
            stderr=e,
            start_new_session=True,
        )
    yield proc, err, out
    if proc.poll() is None:  # a failed test: stop what this test started
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_dead_executor_is_reported_and_restarted_and_sigterm_stops_both_cleanly(supervisor):
    proc, err, out = supervisor
    assert wait_for(lambda: len(live_embedded()) == 1, GUARD), err.read_text()
    first = live_embedded()[0]

    os.kill(first.pid, signal.SIGKILL)  # the executor this test's supervisor started dies

    def reported() -> bool:
        return f"the executor (run_executor, pid {first.pid}) was killed by signal 9 (SIGKILL)" in err.read_text()

    assert wait_for(reported, GUARD), err.read_text()
    loud = next(line for line in err.read_text().splitlines() if f"pid {first.pid})" in line)
    assert loud.startswith("!!! run_local:") and "runs are NOT moving" in loud and "Restarting it in 1 s" in loud
    assert wait_for(lambda: any(e.pid != first.pid for e in live_embedded()), GUARD), err.read_text()
    second = next(e for e in live_embedded() if e.pid != first.pid)
    assert f"run_local: executor restarted, pid {second.pid}" in err.read_text()

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(GUARD) == 0
    text = err.read_text() + out.read_text()
    assert "Segmentation fault" not in text and "Traceback" not in text
    assert "run_local: SIGTERM: stopping the executor and the console" in text and "run_local: stopped" in text
    second.refresh_from_db()
    first.refresh_from_db()
    assert second.stopped_at is not None  # the restarted one left cleanly
    assert first.stopped_at is None  # the killed one never said goodbye: silent


def test_ctrl_c_stops_both_with_exit_0(supervisor):
    proc, err, out = supervisor
    assert wait_for(lambda: len(live_embedded()) == 1, GUARD), err.read_text()
    executor = live_embedded()[0]
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends to its foreground group
    assert proc.wait(GUARD) == 0
    text = err.read_text() + out.read_text()
    assert "Segmentation fault" not in text and "Traceback" not in text and "!!!" not in text
    executor.refresh_from_db()
    assert executor.stopped_at is not None


def test_make_run_starts_the_supervisor_and_no_recursive_trap():
    recipe = (ROOT / "Makefile").read_text().split("\nrun: migrate\n", 1)[1].split("\n\n", 1)[0]
    assert "manage.py run_local" in recipe and "trap" not in recipe and "kill 0" not in recipe
