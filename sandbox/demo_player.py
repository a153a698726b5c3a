"""The demo's player: plays each scenario of ``demo_scenarios`` through the real engine against
the real simulated systems, as the executor and the outbox publisher would.

Every state comes from the engine's own transitions: faults are armed in the sandbox (as the
``sandbox fault`` command does), a failpoint stops the executor where a crash would, the
model provider is swapped for one that answers off-schema, and the engine's clock is moved
forward instead of sleeping through retry intervals. No row is written by hand.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.management.base import CommandError
from django.utils import timezone

from recovery import clock as engine_clock
from recovery.engine import failpoints, transitions
from recovery.engine.executor import advance
from recovery.engine.publisher import publish
from recovery.models import OutboxMessage, RunState, WorkflowRun
from sandbox import faults
from sandbox.demo_scenarios import (
    DISPUTE_OUTCOMES,
    DISPUTES,
    LIVE,
    MODEL_SCRIPT,
    OUTCOMES,
    SCENARIOS,
    Dispute,
    Scenario,
)
from sandbox.models import Fault

OWNER = "seed-demo"
# Demo events arrive this far apart, over the past hours; retries fit inside a slot.
SLOT = timedelta(minutes=10)
MAX_ROUNDS = 60
# How long the seed's runs stay its own if it dies mid-play (it releases them when it finishes).
RESERVATION = timedelta(minutes=15)


class _Clock:
    """The engine's clock for the seed: starts in the past, jumps instead of sleeping, and
    ticks a little with each reading so that a run's events do not all share one instant."""

    TICK = timedelta(milliseconds=40)

    def __init__(self, start: datetime) -> None:
        self.current = start

    def now(self) -> datetime:
        self.current += self.TICK
        return self.current

    def set(self, when: datetime) -> None:
        self.current = max(self.current, when)

    def advance(self, seconds: float) -> None:
        self.current += timedelta(seconds=seconds)


class Seeder:
    """Plays scenarios: each starts its run on its version of the workflow, arms what its story
    needs, and drives the run the way the executor and the outbox publisher would, until it rests."""

    def __init__(
        self,
        *,
        supervisor: AbstractBaseUser,
        drop_ms: int,
        warn: Callable[[str], object],
        generation: int = 1,
        script: Path = MODEL_SCRIPT,
    ) -> None:
        self.supervisor = supervisor
        self.drop_ms = drop_ms
        self.warn = warn
        self.generation = generation
        self.script = script
        self.armed: list[int] = []
        self.played: list[int] = []
        past = sum(1 for s in SCENARIOS if s.play not in LIVE)
        self.start = timezone.now() - SLOT * (past + 1)
        self.clock = _Clock(self.start)

    def play(self, scenarios: list[Scenario]) -> None:
        for scenario in scenarios:
            if scenario.play in LIVE:
                run = self._play(scenario)
            else:
                self.clock.set(self.start + SLOT * SCENARIOS.index(scenario))
                with engine_clock.driven_by(self.clock.now):
                    run = self._play(scenario)
            if run.state != OUTCOMES[scenario.play]:
                expected = OUTCOMES[scenario.play]
                self.warn(f"seed_demo: {run.workflow_id} ended {run.state}, expected {expected}")

    def play_disputes(self, disputes: list[Dispute]) -> None:
        """After the invoices: each dispute in the slot after the last invoice's, on the past clock."""
        for number, dispute in enumerate(disputes, start=1):
            self.clock.set(self.start + SLOT * (len(SCENARIOS) - len(LIVE)) + SLOT * number / (len(DISPUTES) + 1))
            with engine_clock.driven_by(self.clock.now):
                reserve = (OWNER, timezone.now() + RESERVATION)
                run, _ = transitions.run_start(workflow="dispute", data=dispute.event(self.generation), reserve=reserve)
                self.played.append(run.pk)
                run = getattr(self, dispute.play)(run)
            if run.state != DISPUTE_OUTCOMES[dispute.dispute_id]:
                self.warn(
                    f"seed_demo: {run.workflow_id} ended {run.state}, expected {DISPUTE_OUTCOMES[dispute.dispute_id]}"
                )

    def _play(self, scenario: Scenario) -> WorkflowRun:
        # Reserved for the seed in real time: executors running beside it (make run's, Celery's)
        # leave the run alone until the seed has played its story and released it.
        reserve = (OWNER, timezone.now() + RESERVATION)
        run, _ = transitions.run_start(
            workflow=scenario.workflow(), data=scenario.event(self.generation), reserve=reserve
        )
        self.played.append(run.pk)
        return getattr(self, scenario.play)(run)

    def release(self) -> None:
        """Give the played runs to every executor (the waiting one must be retried by them)."""
        transitions.runs_release_reservation(run_pks=self.played, owner=OWNER)

    def arm(self, service: str, operation: str, mode: str, **options: int) -> None:
        self.armed.append(faults.set_fault(service, operation, mode, **options).pk)

    def disarm(self) -> None:
        """Remove the seed's fault rows (all consumed when every scenario went as planned)."""
        Fault.objects.using(faults.DB).filter(pk__in=self.armed).delete()

    def drive(self, run: WorkflowRun, *, jump: bool = True) -> WorkflowRun:
        """Advance the run and deliver its outbox as production would; with ``jump``, move the
        clock to each retry time (or past a stopped executor's lease) until the run rests."""
        for _ in range(MAX_ROUNDS):
            advance(run.pk, owner=OWNER)
            for pk in OutboxMessage.objects.filter(run_id=run.pk).values_list("pk", flat=True):
                publish(pk, owner=OWNER)
            run.refresh_from_db()
            if run.lease_owner:  # an executor stopped holding it: its lease must expire first
                if not jump:
                    return run
                self.clock.advance(settings.RECOVERY_LEASE_SECONDS + 1)
            elif run.next_wake_at is not None and run.next_wake_at > engine_clock.now():
                if not jump:
                    return run
                self.clock.set(run.next_wake_at)
            elif run.next_wake_at is None and run.state not in (RunState.PENDING, RunState.COMPENSATING):
                return run
        raise CommandError(f"seed_demo: {run.workflow_id} did not come to rest ({run.state})")

    # --- the scenarios ------------------------------------------------------------------

    def plain(self, run: WorkflowRun) -> WorkflowRun:
        return self.drive(run)

    def task_answer_lost(self, run: WorkflowRun) -> WorkflowRun:
        """The tracker commits the task and the answer is lost: found by its key, one task."""
        self.arm("tasks", "create", "commit_then_drop", delay_ms=self.drop_ms)
        return self.drive(run)

    def ledger_unavailable_once(self, run: WorkflowRun) -> WorkflowRun:
        self.arm("ledger", "post", "unavailable")
        return self.drive(run)

    def message_answer_lost(self, run: WorkflowRun) -> WorkflowRun:
        """The messenger sends and the answer is lost: the outbox finds it, never resends."""
        self.arm("messages", "send", "commit_then_drop", delay_ms=self.drop_ms)
        return self.drive(run)

    def compensated(self, run: WorkflowRun) -> WorkflowRun:
        run = self.drive(run)
        self.clock.advance(300)
        transitions.run_compensate(
            workflow_id=run.workflow_id,
            actor=self.supervisor,
            reason="demo: duplicate of SI-7780, the vendor sent the invoice twice",
        )
        return self.drive(run)

    def unknown_outcome(self, run: WorkflowRun) -> WorkflowRun:
        """The tracker commits and the answer is lost; the executor stops right after recording
        the unknown outcome, and the tracker's look-up is unreachable for the whole look-up
        budget: the step stays unknown and an operator must reconcile it."""
        self.arm("tasks", "create", "commit_then_drop", delay_ms=self.drop_ms)
        with temporary_environ(RECOVERY_FAILPOINTS="create_approval_task:after_outcome=raise"):
            try:
                advance(run.pk, owner=OWNER)
            except failpoints.FailpointRaised:
                pass
        with temporary_settings(SANDBOX_URL=_unreachable_url()):
            return self.drive(run)

    def task_forbidden(self, run: WorkflowRun) -> WorkflowRun:
        self.arm("tasks", "create", "forbidden")
        return self.drive(run)

    def model_off_schema(self, run: WorkflowRun) -> WorkflowRun:
        # The model answers this invoice off schema (MODEL_PROVIDER=scripted, the demo's script).
        with temporary_settings(MODEL_PROVIDER="scripted", MODEL_SCRIPT=str(self.script)):
            return self.drive(run)

    def model_wrong_approver(self, run: WorkflowRun) -> WorkflowRun:
        # The model names the IT lead for EUR 14,200 of laptops; the policy says the CFO. The
        # approval_policy guard stops the run before any task, message or entry exists.
        return self.model_off_schema(run)

    def compensation_fails(self, run: WorkflowRun) -> WorkflowRun:
        self.arm("ledger", "post", "forbidden")
        run = self.drive(run)
        self.clock.advance(240)
        self.arm("tasks", "cancel", "forbidden")
        transitions.run_compensate(
            workflow_id=run.workflow_id, actor=self.supervisor, reason="demo: vendor withdrew the invoice"
        )
        return self.drive(run)

    def message_forbidden(self, run: WorkflowRun) -> WorkflowRun:
        self.arm("messages", "send", "forbidden")
        return self.drive(run)

    def ledger_forbidden(self, run: WorkflowRun) -> WorkflowRun:
        """The ledger refuses (403) after the task and the message exist: the run fails there,
        nobody has compensated or resumed it yet."""
        self.arm("ledger", "post", "forbidden")
        return self.drive(run)

    def dispute_held(self, run: WorkflowRun) -> WorkflowRun:
        """The agent asks for a credit note above the limit: it waits for a supervisor's decision
        (the Inbox lists it), its deadline days away — the clock is not moved to it."""
        return self.drive(run, jump=False)

    def dispute_stopped(self, run: WorkflowRun) -> WorkflowRun:
        """The ledger is down when the agent issues its credit note; while the call waits for
        its retry, a supervisor stops the agent: nothing more is asked or sent until someone
        resumes it, forks it from a turn, or closes the dispute."""
        self.arm("ledger", "post", "unavailable")
        run = self.drive(run, jump=False)
        self.clock.advance(120)
        return transitions.agent_stop(
            workflow_id=run.workflow_id,
            step_name="resolve_dispute",
            actor=self.supervisor,
            reason="demo: the customer called; the credit is being checked with the cleaning contract",
        )

    def ledger_rate_limited(self, run: WorkflowRun) -> WorkflowRun:
        self.arm("ledger", "post", "rate_limit", retry_after=600)
        return self.drive(run, jump=False)


def _unreachable_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextmanager
def temporary_environ(**values: str) -> Iterator[None]:
    """The process environment with ``values`` set, as it was again afterwards."""
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def temporary_settings(**values: Any) -> Iterator[None]:
    saved = {name: getattr(settings, name) for name in values}
    for name, value in values.items():
        setattr(settings, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(settings, name, value)
