"""Real processes on a driven clock, for the crash tests (test_real_crash, test_invoice_crash).

A crashed worker's lease is long (``LEASE``): no assertion may race a process start or a
call's end against it. Whatever must happen "before" or "after" the lease expires runs in a
process whose engine clock (``recovery.clock.now``) is pinned to an instant read from the
database row itself, e.g. one second before or after ``lease_expires_at``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tests.support.engine import free_port, subprocess_env

MANAGE = str(Path(__file__).resolve().parents[2] / "manage.py")
LEASE = 300  # seconds: far longer than any process start, so wall-clock time never decides a claim
MARGIN = timedelta(seconds=1)
TIMEOUT = 300  # a hang guard for one process, not a timing assumption

# `manage.py` with the engine's clock pinned to RECOVERY_TEST_CLOCK (an ISO time), set before
# any command runs: the engine reads time only through recovery.clock.now.
CLOCK_SHIM = """
import os, sys
from datetime import datetime
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))
from recovery import clock
pinned = datetime.fromisoformat(os.environ["RECOVERY_TEST_CLOCK"])
assert pinned.tzinfo is not None, pinned
clock.now = lambda: pinned
from django.core.management import execute_from_command_line
execute_from_command_line(sys.argv[1:])
"""


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str
    owner: str  # the lease owner this process's executor wrote (transitions.default_owner)


def manage(*args: str, at: datetime | None = None, **env: str) -> Finished:
    """Run `manage.py ARGS` in a new process with a LEASE-second lease; with ``at``, its
    engine clock stands still at that instant."""
    env = subprocess_env(RECOVERY_LEASE_SECONDS=str(LEASE), **env)
    argv = [sys.executable, MANAGE, *args]
    if at is not None:
        env["RECOVERY_TEST_CLOCK"] = at.isoformat()
        argv = [sys.executable, "-c", CLOCK_SHIM, MANAGE, *args]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return Finished(proc.returncode, stdout, stderr, f"{socket.gethostname()}:{proc.pid}")


@pytest.fixture
def sandbox_manage(live_server):
    """``manage`` with the live server's simulated systems as SANDBOX_URL; faults cleared before and after."""
    from sandbox import faults

    faults.clear()

    def run(*args: str, **kwargs):
        return manage(*args, SANDBOX_URL=live_server.url, **kwargs)

    yield run
    faults.clear()


@pytest.fixture
def redis_url(tmp_path):
    """A Redis of the test's own on a free port (the machine's is shared), stopped after it."""
    port = free_port()
    server = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        if (
            subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip()
            == "PONG"
        ):
            break
        time.sleep(0.05)
    yield url
    server.terminate()
    server.wait(10)


def wait_for(predicate, timeout: float = 45.0) -> bool:
    """Poll ``predicate`` until it holds: a hang guard (``timeout``), not a timing assumption."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False
