"""The allowed transitions of a run and of a step: action -> (states it may start from, state it
leads to). Every transition function checks its move against these tables."""

from __future__ import annotations

from recovery.models import TERMINAL_RUN_STATES as TERMINAL_RUN_STATES  # re-exported: the engine reads it here
from recovery.models import RunState, StepState
from recovery.states import AuditAction

EXECUTOR = "executor"

# Where a pause stops a run: before a new attempt (a call begun, a message queued, a compensation
# sent). An operator's pause of the run (transitions.pauses), or a supervisor's of its workflow or of
# that step — a step's pause holds its compensation too: the same receiver — (transitions.
# workflow_pauses), which the write of a new attempt checks itself.
PAUSE_POINTS = frozenset({AuditAction.STEP_BEGIN, AuditAction.STEP_ENQUEUE, AuditAction.COMPENSATION_BEGIN})

# action -> (states it may start from, state it leads to)
RUN_TRANSITIONS: dict[str, tuple[frozenset[RunState], RunState]] = {
    "claim": (frozenset({RunState.PENDING, RunState.WAITING, RunState.RUNNING}), RunState.RUNNING),
    "claim_compensation": (frozenset({RunState.COMPENSATING}), RunState.COMPENSATING),
    "wait": (frozenset({RunState.RUNNING}), RunState.WAITING),
    "release": (frozenset({RunState.RUNNING}), RunState.PENDING),
    "complete": (frozenset({RunState.RUNNING}), RunState.COMPLETED),
    "review": (frozenset({RunState.RUNNING, RunState.COMPENSATING}), RunState.NEEDS_REVIEW),
    "fail": (frozenset({RunState.RUNNING}), RunState.FAILED),
    "resume": (frozenset({RunState.NEEDS_REVIEW, RunState.FAILED, RunState.WAITING}), RunState.PENDING),
    # an operator drops a waiting step's backoff: its next attempt now, its budget as it is
    "retry_now": (frozenset({RunState.WAITING}), RunState.PENDING),
    # an operator pauses a run that moves by itself: at once, or (held by a live executor) at its
    # next step boundary, once the call in flight is recorded (pause_reached)
    "pause": (
        frozenset({RunState.PENDING, RunState.WAITING, RunState.RUNNING, RunState.COMPENSATING}),
        RunState.PAUSED,
    ),
    "pause_reached": (frozenset({RunState.RUNNING, RunState.COMPENSATING}), RunState.PAUSED),
    "unpause": (frozenset({RunState.PAUSED}), RunState.PENDING),
    # a run paused while it compensated goes on compensating (transitions.pauses.resumed_state)
    "unpause_compensation": (frozenset({RunState.PAUSED}), RunState.COMPENSATING),
    # an operator stops an agent step, even while an executor runs it (its lease is fenced off)
    "hold": (
        frozenset({RunState.PENDING, RunState.RUNNING, RunState.WAITING, RunState.NEEDS_REVIEW, RunState.FAILED}),
        RunState.NEEDS_REVIEW,
    ),
    "terminate": (
        frozenset(
            {
                RunState.PENDING,
                RunState.RUNNING,
                RunState.WAITING,
                RunState.NEEDS_REVIEW,
                RunState.FAILED,
                RunState.COMPENSATION_FAILED,
                RunState.PAUSED,
            }
        ),
        RunState.TERMINATED,
    ),
    "compensate": (
        frozenset(
            {
                RunState.PENDING,
                RunState.WAITING,
                RunState.NEEDS_REVIEW,
                RunState.FAILED,
                RunState.COMPLETED,
                RunState.COMPENSATION_FAILED,
                RunState.TERMINATED,
            }
        ),
        RunState.COMPENSATING,
    ),
    # to another version of the workflow: a run that would go on by itself is due at once; one in
    # review or failed stays there (an operator resumes it)
    "move_version": (
        frozenset({RunState.PENDING, RunState.WAITING, RunState.RUNNING, RunState.NEEDS_REVIEW, RunState.FAILED}),
        RunState.PENDING,
    ),
    # a supervisor restarts a run at rest from one of its steps with a corrected input
    # (transitions.restarts): due again at once, or once the effects to undo first are undone
    "restart": (
        frozenset(
            {
                RunState.PENDING,
                RunState.WAITING,
                RunState.NEEDS_REVIEW,
                RunState.FAILED,
                RunState.COMPLETED,
                RunState.COMPENSATED,
            }
        ),
        RunState.PENDING,
    ),
    "compensation_wait": (frozenset({RunState.COMPENSATING}), RunState.COMPENSATING),
    "compensation_fail": (frozenset({RunState.COMPENSATING}), RunState.COMPENSATION_FAILED),
    # the target depends on what is left: compensated, completed, or needs_review
    "compensation_done": (frozenset({RunState.COMPENSATING}), RunState.COMPENSATED),
}

STEP_TRANSITIONS: dict[str, tuple[frozenset[StepState], StepState]] = {
    "begin": (frozenset({StepState.PENDING, StepState.FAILED, StepState.UNKNOWN}), StepState.RUNNING),
    "succeed": (frozenset({StepState.RUNNING, StepState.UNKNOWN, StepState.PENDING}), StepState.SUCCEEDED),
    # a local step's attempt and its success in one commit: from wherever "begin" may start
    "attempt_succeed": (frozenset({StepState.PENDING, StepState.FAILED, StepState.UNKNOWN}), StepState.SUCCEEDED),
    # from pending/failed: refused before the call (an intent that cannot be built or conflicts)
    "fail": (frozenset({StepState.RUNNING, StepState.PENDING, StepState.FAILED}), StepState.FAILED),
    "mark_unknown": (frozenset({StepState.RUNNING}), StepState.UNKNOWN),
    "defer_reconcile": (frozenset({StepState.UNKNOWN}), StepState.UNKNOWN),
    # a look-up missed while the request may still commit: look again at the window's end
    "await_settle": (frozenset({StepState.UNKNOWN}), StepState.UNKNOWN),
    "reset": (frozenset({StepState.UNKNOWN, StepState.FAILED}), StepState.PENDING),
    "skip": (frozenset({StepState.PENDING}), StepState.SKIPPED),
    # a read made from a model decision an operator replaced: made again from the new one
    "read_again": (frozenset({StepState.SUCCEEDED, StepState.FAILED, StepState.UNKNOWN}), StepState.PENDING),
    # a guard refused the step (or could not read the state it checks) before its intent: nothing sent
    "refuse": (frozenset({StepState.PENDING, StepState.FAILED}), StepState.PENDING),
    # an agent's tool call a guard refused, answered to the model instead of made: nothing sent
    "refuse_to_model": (frozenset({StepState.PENDING, StepState.FAILED}), StepState.SKIPPED),
    # an agent's journal row left out: not made (stopped), or out of the conversation (a fork);
    # a call that succeeded stays succeeded (its effect stands), an unknown one is reconciled first
    "leave_out": (
        frozenset({StepState.PENDING, StepState.FAILED, StepState.SUCCEEDED, StepState.WAITING}),
        StepState.SKIPPED,
    ),
    "defer_check": (frozenset({StepState.PENDING, StepState.FAILED}), StepState.PENDING),
    # a restart from this step or an earlier one: made again (a new key where it had an effect)
    "restart": (
        frozenset(
            {
                StepState.PENDING,
                StepState.FAILED,
                StepState.SUCCEEDED,
                StepState.SKIPPED,
                StepState.COMPENSATED,
                StepState.WAITING,
            }
        ),
        StepState.PENDING,
    ),
    # a wait step reached: it waits for its event or its time (recovery.engine.transitions.waits)
    "wait": (frozenset({StepState.PENDING}), StepState.WAITING),
    # its event applied (one kept from before it was reached, too), or its deadline's default taken
    "wait_end": (frozenset({StepState.PENDING, StepState.WAITING}), StepState.SUCCEEDED),
    # its deadline passed with no event, and the wait declares review
    "wait_time_out": (frozenset({StepState.WAITING}), StepState.FAILED),
    # a tool call that waited for a person (transitions.call_approvals), decided: approved or edited
    # (made next), rejected (answered to the model), answered in the tool's place
    "call_decided": (frozenset({StepState.WAITING, StepState.FAILED}), StepState.PENDING),
    "call_rejected": (frozenset({StepState.WAITING, StepState.FAILED}), StepState.SKIPPED),
    "call_answered": (frozenset({StepState.WAITING, StepState.FAILED}), StepState.SUCCEEDED),
    "compensate": (frozenset({StepState.SUCCEEDED, StepState.COMPENSATION_FAILED}), StepState.COMPENSATING),
    "compensation_begin": (frozenset({StepState.COMPENSATING}), StepState.COMPENSATING),
    "compensation_succeed": (frozenset({StepState.COMPENSATING}), StepState.COMPENSATED),
    "compensation_fail": (frozenset({StepState.COMPENSATING}), StepState.COMPENSATION_FAILED),
}
LEASED_RUN_STATES = frozenset({RunState.RUNNING, RunState.COMPENSATING})

DONE_STEP_STATES = frozenset({StepState.SUCCEEDED, StepState.SKIPPED})
