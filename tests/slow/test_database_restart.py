"""A database restart while a worker is inside a step's call is a blip, not a review.

The production incident, with real processes: the embedded executor (``run_executor``, keeping
its connection: DATABASE_CONN_MAX_AGE=60) is inside ``create_approval_task``'s call, held by the
tracker, when PostgreSQL restarts (``pg_ctl stop -m fast`` terminates every session; ``-m
immediate`` is a crash). The checkpoint after the call meets a dead connection. The run must not
be parked for it: the executor lets go and backs off, the lease expires, the next claim finds
the step ``running``, records it unknown and looks the task up by its idempotency key. The run
completes with exactly one task, one message and one ledger entry, and nobody acted on it.

Only the engine's database restarts: it lives in a throwaway cluster of its own
(tests/support/pgcluster.py), never the machine's shared server and never the suite's database;
the simulated systems keep theirs in a SQLite file, served by their own ``runserver``.

Nothing races the wall clock: the restart starts once the step is seen ``running`` and must be
over while the tracker still holds the call (HOLD_MS, against a restart of well under a second;
checked after the fact: the step is still ``running`` once the server is back). The takeover
waits for the executor's own lease to expire; the test only polls, under a hang guard.

The child processes use ``config.settings``, not ``config.test_settings``: the latter pins the
adapters' timeout to 1 s, which would turn the held call into a timeout before the restart.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import pgcluster

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MANAGE = str(ROOT / "manage.py")

STEP = "create_approval_task"
HOLD_MS = 8_000  # the tracker holds the call this long, then answers: time enough for a restart
HTTP_TIMEOUT = 20  # seconds: the adapters wait longer than HOLD_MS, so the call succeeds
LEASE = 30  # seconds; manage.py check: timeout + heartbeat <= lease
HEARTBEAT = 10
HANG_GUARD = 240  # seconds: a hang guard for the whole recovery, not a timing assumption
RESTING = {"completed", "needs_review", "failed", "compensated", "compensation_failed", "terminated"}
SANDBOX_KEY = "database-restart-sandbox-key"

# Variables of the surrounding environment that would point a child at another database, broker,
# model or fault; the children get exactly what this test sets.
INHERITED_PREFIXES = ("DATABASE_", "SANDBOX_", "RECOVERY_", "CELERY_", "OPENAI_", "MODEL_", "DJANGO_", "PG")


class Children:
    """Every process this test started, with its output in files; all stopped at the end."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        # Files, not pipes: nobody has to drain them, and they are there to read on failure.
        with open(self.logs / f"{name}.out", "w") as out, open(self.logs / f"{name}.err", "w") as err:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        self.procs.append((name, proc))
        return proc

    def stderr(self, name: str, chars: int = 6000) -> str:
        path = self.logs / f"{name}.err"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop_all(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)


@pytest.fixture
def cluster() -> Iterator[pgcluster.PgCluster]:
    with pgcluster.cluster() as pg:
        yield pg


@pytest.fixture
def children(tmp_path) -> Iterator[Children]:
    started = Children(tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


def child_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_PREFIXES)}
    env.update(
        DJANGO_SETTINGS_MODULE="config.settings",
        DJANGO_DEBUG="1",
        PYTHONUNBUFFERED="1",
        RECOVERY_EXECUTOR="embedded",
        MODEL_PROVIDER="rules",
        SANDBOX_API_KEY=SANDBOX_KEY,
        RECOVERY_HTTP_TIMEOUT=str(HTTP_TIMEOUT),
        RECOVERY_LEASE_SECONDS=str(LEASE),
        RECOVERY_HEARTBEAT_SECONDS=str(HEARTBEAT),
    )
    env.update(settings)
    return env


def manage_in(env: dict[str, str]) -> Callable[..., str]:
    def manage(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, MANAGE, *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=180,  # a hang guard for one command
        )
        assert done.returncode == 0, f"manage.py {' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}"
        return done.stdout

    return manage


def wait_for(what: str, probe: Callable[[], object], *, timeout: float, diagnose: Callable[[], str]) -> object:
    """Poll ``probe`` until it returns something truthy; fail (with ``diagnose()``) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(0.1)
    pytest.fail(f"{what}: not within {timeout} s (hang guard)\n{diagnose()}")


def wait_for_port(port: int, proc: subprocess.Popen, diagnose: Callable[[], str]) -> None:
    def listening() -> bool:
        assert proc.poll() is None, f"the sandbox server exited {proc.returncode}\n{diagnose()}"
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for("the sandbox server listening", listening, timeout=60, diagnose=diagnose)


def show_run_anyway(env: dict[str, str], workflow_id: str) -> str:
    """``show_run --json``'s audit trail, for a failure message: whatever it prints, never raises."""
    try:
        done = subprocess.run(
            [sys.executable, MANAGE, "show_run", workflow_id, "--json"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
        doc = json.loads(done.stdout)
    except (subprocess.SubprocessError, ValueError) as exc:
        return f"(show_run failed: {exc})"
    events = [f"{e['at']} {e['action']} {e['step']} {e['after']} {e['reason']}" for e in doc["audit"]]
    return f"{doc['state']}: {doc['status_reason']}\n" + "\n".join(events)


class EngineDatabase:
    """Reads the run straight from the cluster (psycopg, a new connection each time: the
    server may be restarting), so that the test never holds a session the restart must end."""

    def __init__(self, url: str, workflow_id: str):
        self.url = url
        self.workflow_id = workflow_id

    def states(self) -> tuple[str, dict[str, str]] | None:
        import psycopg

        try:
            with psycopg.connect(self.url, connect_timeout=5) as conn:
                run = conn.execute(
                    "SELECT id, state FROM recovery_workflowrun WHERE workflow_id = %s", [self.workflow_id]
                ).fetchone()
                if run is None:
                    return None
                steps = conn.execute(
                    "SELECT step_name, state FROM recovery_stepexecution WHERE run_id = %s", [run[0]]
                ).fetchall()
        except psycopg.OperationalError:
            return None
        return run[1], dict(steps)


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_database_restart_during_a_call_is_a_blip_not_a_review(mode, cluster, children, tmp_path):
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("brings its own PostgreSQL cluster whatever the suite uses: runs once, in the PostgreSQL pass")
    cluster.create_database("recovery")
    sandbox_db = tmp_path / "sandbox.sqlite3"
    sandbox_port = pgcluster.free_port()
    sandbox_url = f"http://127.0.0.1:{sandbox_port}"
    engine_env = child_env(
        DATABASE_URL=cluster.url("recovery"),
        SANDBOX_DATABASE_URL=f"sqlite:///{sandbox_db}",
        SANDBOX_URL=sandbox_url,
        DATABASE_CONN_MAX_AGE="60",  # workers keep their connection, as in production
    )
    # The simulated systems never touch the engine's database: their server's default alias is
    # a file of its own, so the restart reaches the executor alone.
    server_env = {**engine_env, "DATABASE_URL": f"sqlite:///{tmp_path / 'server-default.sqlite3'}"}
    manage = manage_in(engine_env)
    manage("migrate", "--noinput")
    manage("migrate", "--database", "sandbox", "--noinput")

    server = children.start(
        "sandbox", [sys.executable, MANAGE, "runserver", f"127.0.0.1:{sandbox_port}", "--noreload"], server_env
    )
    wait_for_port(sandbox_port, server, lambda: children.stderr("sandbox"))

    manage("sandbox", "fault", "tasks", "create", "slow", "--delay-ms", str(HOLD_MS))
    event = {
        "tenant": "tenant-db",
        "invoice_id": f"restart-{mode}",
        "text": "40 ergonomic chairs. Total due EUR 1,840.00",
    }
    wid = manage("start_workflow", "invoice", "--input", json.dumps(event)).strip()
    engine = EngineDatabase(cluster.url("recovery"), wid)

    executor = children.start("executor", [sys.executable, MANAGE, "run_executor"], engine_env)

    def diagnose() -> str:
        states = engine.states()
        return (
            f"run: {states}\nexecutor ({'running' if executor.poll() is None else f'exit {executor.returncode}'}) "
            f"stderr:\n{children.stderr('executor')}\n--- sandbox stderr ---\n{children.stderr('sandbox', 2000)}"
            f"\n--- cluster log ---\n{cluster.log_tail(2000)}\n--- show_run ---\n{show_run_anyway(engine_env, wid)}"
        )

    def step_in_flight() -> bool:
        states = engine.states()
        if states is None:
            return False
        run_state, steps = states
        assert run_state not in RESTING, f"the run came to rest before {STEP} was called\n{diagnose()}"
        return steps.get(STEP) == "running"

    wait_for(f"{STEP} running (its call held by the tracker)", step_in_flight, timeout=60, diagnose=diagnose)

    cluster.restart(mode=mode)

    # The restart must have landed inside the call: its outcome is not written yet. (If this
    # fails, the call's outcome was committed before the server stopped: HOLD_MS is too short
    # on this machine; or a commit was lost in the crash: see the cluster's settings.)
    after_restart = wait_for("the restarted cluster answering", engine.states, timeout=60, diagnose=diagnose)
    assert after_restart[1].get(STEP) == "running", f"the restart did not land within the call\n{diagnose()}"

    def at_rest() -> str | None:
        assert executor.poll() is None, f"the executor stopped (exit {executor.returncode})\n{diagnose()}"
        states = engine.states()
        return states[0] if states and states[0] in RESTING else None

    wait_for("the run at rest", at_rest, timeout=HANG_GUARD, diagnose=diagnose)
    assert executor.poll() is None, f"the executor stopped (exit {executor.returncode})\n{diagnose()}"

    doc = json.loads(manage("show_run", wid, "--json"))
    trail = json.dumps(doc["audit"], indent=1)
    assert doc["state"] == "completed", (
        f"{doc['state']}: {doc['status_reason']}\nexecutor stderr:\n{children.stderr('executor')}\naudit:\n{trail}"
    )
    assert [s["name"] for s in doc["steps"] if s["state"] == "running"] == [], trail
    assert all(s["state"] == "succeeded" for s in doc["steps"]), json.dumps(doc["steps"], indent=1)
    assert [e for e in doc["audit"] if e["action"] == "review"] == [], trail
    parked = [
        e for e in doc["audit"] if "needs_review" in {(e["after"] or {}).get("run"), (e["after"] or {}).get("state")}
    ]
    assert parked == [], trail
    operators = {e["actor"] for e in doc["audit"] if e["action"] != "start"} - {"executor"}
    assert operators == set(), f"an operator acted on the run\n{trail}"

    counts = json.loads(manage("sandbox", "counts", "--json"))
    expected = {"tasks": 1, "messages": 1, "ledger_entries": 1}
    expected |= {"tasks_cancelled": 0, "corrections": 0, "ledger_reversals": 0}
    assert {name: counts.get(name) for name in expected} == expected, counts
