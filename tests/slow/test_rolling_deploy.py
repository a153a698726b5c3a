"""A rolling deploy under real process death (issue 32): two embedded executors side by side, one
still on the old code (test_versioned v1 and v2), one already on the new (v2 only), each killed
(SIGKILL) again and again and started again, while v1 and v2 runs are in flight. The old
executor finishes the v1 runs, either finishes v2 runs, the new one never touches a v1 run, and
every run completes with one object per step, none parked for review.

Kills land at random moments: the assertions are on outcomes only (what the runs, the receivers
and the audit trail hold at the end), never on when a process starts or a call ends."""

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunState, WorkflowRun
from recovery.workflow import get_workflow
from tests.support import receivers
from tests.support.engine import assert_invariants, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

MANAGE = str(Path(__file__).resolve().parents[2] / "manage.py")
RUNS_PER_VERSION = 8
KILLS = 5
HANG_GUARD = 300  # seconds for the whole test: a guard against a hang, not a timing assumption
V2_ONLY = "tests.support.workflows,tests.support.versioned"  # the new code: without tests.support.versioned_v1


def executor(*, old_code: bool) -> subprocess.Popen:
    env = subprocess_env(
        RECOVERY_LEASE_SECONDS="5",
        # every call takes a moment, so that a kill often lands in the middle of a run
        RECOVERY_FAILPOINTS="*:after_call=sleep(100)",
        **({} if old_code else {"RECOVERY_TEST_WORKFLOW_MODULES": V2_ONLY}),
    )
    return subprocess.Popen(
        [sys.executable, MANAGE, "run_executor", "--poll", "0.2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def owner_of(proc: subprocess.Popen) -> str:
    return f"{socket.gethostname()}:{proc.pid}"


def test_a_rolling_deploy_with_executors_killed_at_random_finishes_every_run_once_on_its_version(postgres_only):
    runs = [
        run_start(
            workflow=get_workflow("test_versioned", version), data={"tenant": "roll", "order_id": f"{version}-{i}"}
        )[0]
        for version in (1, 2)
        for i in range(RUNS_PER_VERSION)
    ]
    chance = random.Random(os.environ.get("PYTEST_XDIST_WORKER", "") + str(time.time()))
    procs = {"old": executor(old_code=True), "new": executor(old_code=False)}
    new_owners = {owner_of(procs["new"])}
    deadline = time.monotonic() + HANG_GUARD
    try:
        for _ in range(KILLS):
            time.sleep(chance.uniform(0.3, 2.5))
            which = chance.choice(["old", "new"])
            procs[which].send_signal(signal.SIGKILL)
            procs[which].wait(30)
            procs[which] = executor(old_code=which == "old")
            if which == "new":
                new_owners.add(owner_of(procs["new"]))
        while time.monotonic() < deadline:
            if (
                not WorkflowRun.objects.filter(workflow_name="test_versioned")
                .exclude(state=RunState.COMPLETED)
                .exists()
            ):
                break
            for name, proc in procs.items():
                assert proc.poll() is None, f"the {name} executor exited: {proc.stderr.read()[-2000:]}"
            time.sleep(0.5)
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)

    states = dict(WorkflowRun.objects.filter(pk__in=[r.pk for r in runs]).values_list("workflow_id", "state"))
    assert set(states.values()) == {RunState.COMPLETED}, states
    assert receivers.counts() == {
        "task": 2 * RUNS_PER_VERSION,
        "message": 0,
        "ledger": 2 * RUNS_PER_VERSION,
        "model_call": 0,
    }
    assert not AuditEvent.objects.filter(action="review").exists()
    assert sorted(set(WorkflowRun.objects.values_list("workflow_version", flat=True))) == [1, 2]  # none moved
    claims = AuditEvent.objects.filter(action__in=["claim", "lease_takeover"]).select_related("run")
    by_new = [e.run.workflow_version for e in claims if e.after.get("lease_owner") in new_owners]
    assert 1 not in by_new  # the new code never took a v1 run
    assert_invariants()
