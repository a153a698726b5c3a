"""Property: random sequences of executor work, receiver faults, crashes and operator
transitions never reach an illegal state, never double a side effect, and a finished run
moves only through an explicit operator transition (contract rules 7, 11, 12)."""

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from recovery import clock as engine_clock
from recovery.engine import failpoints, transitions
from recovery.engine.executor import advance
from recovery.engine.publisher import publish_due
from recovery.engine.transitions import TERMINAL_RUN_STATES, run_start
from recovery.errors import InvalidTransition
from recovery.models import RunState, StepState, WorkflowRun
from recovery.testing import MovableClock
from recovery.workflow import compensation_key
from tests.support import receivers
from tests.support.models import RemoteObject

pytestmark = pytest.mark.django_db

ORDER_IDS = itertools.count()
FAULT_KINDS = ["task", "message", "ledger", "task_cancel", "correction", "reversal"]
MODES = ["fail_before_commit", "commit_then_drop", "rate_limit", "forbidden", "unavailable"]
STEPS = ["read", "decide", "create_task", "notify", "post_entry"]


class RunLifecycle(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = MovableClock()
        self._old_now = engine_clock.now
        engine_clock.now = self.clock.now
        receivers.clear()
        self.operator = None

    @initialize()
    def start(self):
        from django.contrib.auth import get_user_model

        n = next(ORDER_IDS)
        self.operator, _ = get_user_model().objects.get_or_create(username="sm-operator")
        self.run, _ = run_start(workflow="test_orders", data={"tenant": "sm", "order_id": f"sm-{n}"})
        self.finished_as = None  # the terminal state the executor must never leave

    def teardown(self):
        engine_clock.now = self._old_now
        receivers.clear()

    def _state(self):
        return WorkflowRun.objects.get(pk=self.run.pk).state

    @rule()
    def executor_advances(self):
        advance(self.run.pk, owner="sm")
        publish_due(owner="sm")

    @rule(step=st.sampled_from(STEPS), point=st.sampled_from(failpoints.POINTS))
    def executor_crashes(self, step, point):
        import os

        os.environ["RECOVERY_FAILPOINTS"] = f"{step}:{point}=raise"
        try:
            advance(self.run.pk, owner="sm-doomed")
        except failpoints.FailpointRaised:
            pass
        finally:
            del os.environ["RECOVERY_FAILPOINTS"]

    @rule(seconds=st.sampled_from([1, 6, 30, 600]))
    def time_passes(self, seconds):
        self.clock.advance(seconds)

    @rule(kind=st.sampled_from(FAULT_KINDS), mode=st.sampled_from(MODES))
    def receiver_misbehaves(self, kind, mode):
        receivers.arm(kind, mode)

    @rule(
        action=st.sampled_from(["resume", "terminate", "compensate", "retry", "reconcile"]), step=st.sampled_from(STEPS)
    )
    def operator_acts(self, action, step):
        before = self._state()
        common = {"workflow_id": self.run.workflow_id, "actor": self.operator, "reason": "property test"}
        try:
            if action == "resume":
                transitions.run_resume(**common)
            elif action == "terminate":
                transitions.run_terminate(**common)
            elif action == "compensate":
                transitions.run_compensate(**common)
            elif action == "retry":
                transitions.step_retry(**common, step_name=step)
            else:
                transitions.step_reconcile(**common, step_name=step)
        except InvalidTransition:
            assert self._state() == before  # a refused action changes nothing
        else:
            self.finished_as = None  # an explicit transition may move a finished run

    @invariant()
    def states_are_legal_and_effects_are_never_doubled(self):
        run = WorkflowRun.objects.get(pk=self.run.pk)
        assert run.state in RunState.values
        for step in run.steps.all():
            assert step.state in StepState.values
            if step.state == StepState.RUNNING:
                assert run.lease_owner, f"{step.step_name} is running with no lease"
        counts = self.effects()
        assert all(n <= 1 for n in counts.values()), counts

    def effects(self) -> dict[str, int]:
        """This run's remote objects (the database is shared by all examples)."""
        wid = self.run.workflow_id
        keys = dict(WorkflowRun.objects.get(pk=self.run.pk).steps.values_list("step_name", "idempotency_key"))
        return {
            "task": RemoteObject.objects.filter(kind="task", dedupe_key=keys["create_task"]).count(),
            "message": RemoteObject.objects.filter(kind="message", client_ref=keys["notify"]).count(),
            "ledger": RemoteObject.objects.filter(kind="ledger", dedupe_key=wid).count(),
            "task_cancel": RemoteObject.objects.filter(
                kind="task_cancel", dedupe_key=compensation_key(wid, "create_task", 1)
            ).count(),
            "correction": RemoteObject.objects.filter(
                kind="correction", client_ref=compensation_key(wid, "notify", 1)
            ).count(),
            "reversal": RemoteObject.objects.filter(
                kind="reversal", dedupe_key=compensation_key(wid, "post_entry", 1)
            ).count(),
        }

    @invariant()
    def finished_runs_stay_finished_without_an_operator(self):
        state = self._state()
        if self.finished_as is not None:
            assert state == self.finished_as, f"a {self.finished_as} run became {state} by itself"
        if state in TERMINAL_RUN_STATES:
            self.finished_as = state


def test_random_sequences_of_work_faults_crashes_and_operator_actions_stay_legal():
    run_state_machine_as_test(
        RunLifecycle,
        settings=settings(
            max_examples=50,
            derandomize=True,
            database=None,
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
