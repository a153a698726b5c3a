"""Helpers the engine tests share: drive a run with the movable clock, crash a worker at a
failpoint, check the invariants that must hold at rest, and start child processes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.conf import settings

from recovery import clock as engine_clock
from recovery import testing
from recovery.engine import evidence, failpoints, transitions
from recovery.models import WorkflowRun
from recovery.testing import MovableClock


def person(username: str, role: str | None = "supervisor"):
    """A user with a console role (a group of that name), or none."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    user = get_user_model().objects.create_user(username, password="pw")
    if role:
        user.groups.add(Group.objects.get_or_create(name=role)[0])
    return user


def resolve_happened(*, workflow_id: str, step_name: str, actor, reason: str, remote_ref: str, **more) -> WorkflowRun:
    """ "It succeeded, remote id X" as every surface does it: the evidence is checked at the
    receiver (recovery.engine.evidence), then recorded by the transition."""
    checked = evidence.examine(
        "resolve_happened", workflow_id=workflow_id, step_name=step_name, remote_ref=remote_ref, actor=actor
    )
    return transitions.step_resolve(
        workflow_id=workflow_id,
        step_name=step_name,
        actor=actor,
        reason=reason,
        happened=True,
        evidence=checked,
        **more,
    )


def crash_at(monkeypatch, failpoint: str, call: Callable[[], Any]) -> None:
    """Run ``call`` with ``failpoint`` (``STEP:POINT``) armed to raise, and expect it to stop
    there as a crash would: the run keeps whatever was committed before that point."""
    monkeypatch.setenv("RECOVERY_FAILPOINTS", f"{failpoint}=raise")
    try:
        with pytest.raises(failpoints.FailpointRaised):
            call()
    finally:
        monkeypatch.delenv("RECOVERY_FAILPOINTS")


def unfolded(monkeypatch) -> None:
    """Executors that write a call's outcome apart from the next call's intent, as before
    recovery.engine.fold: for a test whose stage needs the resting point between the two (a
    fault armed after one call and before the next, a run as a deploy meets it from an executor
    of before the change), which folded executors no longer pass through."""
    from recovery.engine import fold

    monkeypatch.setattr(fold, "_next_call", lambda lease, plan, draft, done: None)


def advance_as_dying_workers(run: WorkflowRun, clock: MovableClock, rounds: int) -> WorkflowRun:
    """``rounds`` executors in turn, each taking the run over once the last one's lease has
    expired; an armed failpoint's raise ends an executor as a crash would."""
    from recovery.engine.executor import advance

    for _ in range(rounds):
        try:
            advance(run.pk)
        except failpoints.FailpointRaised:
            pass
        clock.advance(settings.RECOVERY_LEASE_SECONDS + 1)
    run.refresh_from_db()
    return run


def doomed_worker(run: WorkflowRun, clock: MovableClock, *, rounds: int = 30) -> None:
    """A worker that advances the run and publishes its outbox, moving the clock to each retry
    time, until an armed failpoint kills it (FailpointRaised, as a crash would); then its lease
    runs out, and another may take the run over. At most ``rounds`` rounds."""
    from recovery.engine.executor import advance
    from recovery.engine.publisher import publish_due

    for _ in range(rounds):
        try:
            advance(run.pk, owner="doomed")
            publish_due(owner="doomed")
        except failpoints.FailpointRaised:
            break
        run.refresh_from_db()
        if run.next_wake_at:
            clock.set(run.next_wake_at)
    clock.advance(settings.RECOVERY_LEASE_SECONDS + 1)


def drive(run: WorkflowRun, clock: MovableClock, *, max_rounds: int = 60) -> WorkflowRun:
    """Advance a run the way production would until it comes to rest (recovery.testing.drive);
    fail the test if it does not."""
    return testing.drive(run, clock, max_rounds=max_rounds, owner="test-executor", must_settle=True)


def lease_expired_running_steps() -> list:
    """Steps `running` whose run's lease has expired (the failure tests: none may exist at rest)."""
    from recovery.models import StepExecution, StepState

    now = engine_clock.now()
    return list(StepExecution.objects.filter(state=StepState.RUNNING).exclude(run__lease_expires_at__gt=now))


def assert_invariants() -> None:
    """After every failure test: nothing `running` past its lease, and every succeeded
    side-effecting step keeps its remote reference."""
    from recovery.models import StepExecution, StepState

    assert lease_expired_running_steps() == []
    for step in StepExecution.objects.filter(
        state=StepState.SUCCEEDED, step_name__in=["create_task", "notify", "post_entry"]
    ):
        assert step.remote_ref, f"{step} succeeded without a remote reference"
    for step in StepExecution.objects.filter(state=StepState.COMPENSATED):
        assert step.remote_ref and step.compensation_ref, f"{step} compensated without its evidence"


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child `manage.py` or Celery process that uses this test's database."""
    import os

    from django.db import connections

    env = {k: v for k, v in os.environ.items() if k != "RECOVERY_FAILPOINTS"}
    env.update(
        DATABASE_URL=_database_url(connections["default"]),
        SANDBOX_DATABASE_URL=_database_url(connections["sandbox"]),
        DJANGO_SETTINGS_MODULE="config.test_settings",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def _database_url(conn) -> str:
    db = conn.settings_dict
    if conn.vendor == "postgresql":
        auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
        return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    return f"sqlite:///{db['NAME']}"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
