"""Transition functions: the only code that changes a run or a step.

Each one runs in one ``transaction.atomic()``: it locks the run row (always the run first,
then its steps), checks the allowed-transitions table, saves with ``update_fields`` and
writes exactly one audit event with the state before and after. None does network I/O.

Executor transitions take a ``Lease``: each is decided on a draft of the leased run and
written as a ``Checkpoint`` by ``Lease.commit`` (recovery.engine.transitions.checkpoints),
only while the run's ``lease_generation`` is still the lease's (a fencing token) and its
revision the one decided on, so a worker that wakes up after another executor took its run
over cannot write anything (``LeaseLost``). Each fenced write also renews the lease.

One module per domain (``tables`` holds the allowed moves, ``_core`` what they share); this
package re-exports the public transitions: callers write ``transitions.run_resume(...)``.
"""

from ._core import (
    RUN_LEASE_FIELDS,
    default_owner,
    in_flight_text,
    lease_duration,
    paused_text,
    pausing,
    require_reason,
    run_version,
)
from ._core import _live_lease as lease_is_live
from .acting import LABELS, needs_approval
from .agents import agent_fork, agent_stop, agent_turn_add, agent_turn_record
from .alerts import (
    AUTO_PAUSED,
    alert_delivered,
    alert_deliveries_claim,
    alert_delivery_failed,
    alert_raise,
    alert_raise_paused,
    alert_resolve,
    alert_snooze,
)
from .approvals import approval_decide, approval_grant, approval_reject, approval_request
from .call_approvals import (
    DECISIONS,
    already_decided,
    approval_needed,
    approval_text,
    awaits_decision,
    call_answer,
    call_approval_escalate,
    call_approval_time_out,
    call_approve,
    call_edit,
    call_hold,
    call_reject,
    item_take,
)
from .checkpoints import Draft, FenceMiss, Lease, leased_run
from .compensation import (
    compensation_begin,
    compensation_fail,
    compensation_succeed,
    compensation_unconfirmed,
    run_compensate,
    run_compensation_done,
)
from .decisions import decision_supersede
from .executors import executor_beat, executor_register, executor_stop, executors_prune
from .leases import (
    claimable,
    outbox_dispatch,
    run_claim,
    run_claim_next,
    runs_dispatch,
    runs_release_reservation,
    sweeper_beat,
)
from .offers import AGENT_STOPPED, UNDONE_STEP_STATES, Situation, offered, why_not
from .operator import (
    BUDGET_FIELDS,
    run_resume,
    run_terminate,
    step_override,
    step_reconcile,
    step_reset_attempts,
    step_resolve,
    step_retry,
    step_retry_now,
)
from .outbox import (
    OutboxClaim,
    outbox_await_settle,
    outbox_cancel,
    outbox_claim,
    outbox_delivered,
    outbox_due,
    outbox_failed_attempt,
    outbox_unresolved,
    step_enqueue,
)
from .pauses import run_pause, run_pause_reached, run_unpause
from .perform import perform
from .performers import PERFORMERS, check_complete
from .releases import workflow_unpause
from .restart_plan import RestartPlan, change_text, corrected_intent
from .restarts import restart_apply, restart_preview, run_restart
from .runs import (
    Started,
    run_complete,
    run_release,
    run_review,
    run_start,
    run_start_claimed,
    run_start_many,
    run_wait,
)
from .steps import (
    step_await_settle,
    step_begin,
    step_defer_check,
    step_defer_reconcile,
    step_fail,
    step_mark_unknown,
    step_refuse,
    step_reset,
    step_succeed,
)
from .tables import (
    DONE_STEP_STATES,
    EXECUTOR,
    LEASED_RUN_STATES,
    RUN_TRANSITIONS,
    STEP_TRANSITIONS,
    TERMINAL_RUN_STATES,
)
from .versions import (
    MovePlan,
    accepted_by_run,
    accepted_decisions,
    continuation,
    drift,
    move_plan,
    run_move_version,
)
from .waits import (
    EventHere,
    event_for,
    run_deliver_event,
    wait_apply,
    wait_begin,
    wait_escalate,
    wait_skip,
    wait_time_out,
    waiting_text,
    waits_for_event,
)
from .waves import Waves
from .workflow_pauses import in_force as workflow_pauses_in_force
from .workflow_pauses import workflow_pause, workflow_pause_if_failing

__all__ = [
    "DECISIONS",
    "already_decided",
    "approval_needed",
    "approval_text",
    "awaits_decision",
    "call_answer",
    "call_approval_escalate",
    "call_approval_time_out",
    "call_approve",
    "call_edit",
    "call_hold",
    "call_reject",
    "item_take",
    "EventHere",
    "event_for",
    "run_deliver_event",
    "wait_apply",
    "wait_begin",
    "wait_escalate",
    "wait_skip",
    "wait_time_out",
    "waiting_text",
    "waits_for_event",
    "RestartPlan",
    "change_text",
    "corrected_intent",
    "restart_apply",
    "restart_preview",
    "run_restart",
    "AUTO_PAUSED",
    "Waves",
    "pausing",
    "paused_text",
    "run_pause",
    "run_pause_reached",
    "run_unpause",
    "workflow_pause",
    "workflow_pause_if_failing",
    "workflow_pauses_in_force",
    "workflow_unpause",
    "PERFORMERS",
    "MovePlan",
    "accepted_by_run",
    "accepted_decisions",
    "continuation",
    "drift",
    "move_plan",
    "run_move_version",
    "AGENT_STOPPED",
    "agent_fork",
    "agent_stop",
    "agent_turn_add",
    "agent_turn_record",
    "alert_deliveries_claim",
    "alert_delivered",
    "alert_delivery_failed",
    "alert_raise",
    "alert_raise_paused",
    "alert_resolve",
    "alert_snooze",
    "BUDGET_FIELDS",
    "DONE_STEP_STATES",
    "EXECUTOR",
    "LABELS",
    "LEASED_RUN_STATES",
    "Lease",
    "Draft",
    "FenceMiss",
    "OutboxClaim",
    "RUN_LEASE_FIELDS",
    "RUN_TRANSITIONS",
    "STEP_TRANSITIONS",
    "TERMINAL_RUN_STATES",
    "approval_decide",
    "approval_grant",
    "approval_reject",
    "approval_request",
    "claimable",
    "compensation_begin",
    "compensation_fail",
    "compensation_succeed",
    "compensation_unconfirmed",
    "decision_supersede",
    "step_override",
    "default_owner",
    "in_flight_text",
    "lease_duration",
    "leased_run",
    "needs_approval",
    "outbox_await_settle",
    "outbox_cancel",
    "outbox_claim",
    "outbox_delivered",
    "outbox_dispatch",
    "outbox_due",
    "outbox_failed_attempt",
    "outbox_unresolved",
    "perform",
    "Situation",
    "UNDONE_STEP_STATES",
    "lease_is_live",
    "offered",
    "why_not",
    "require_reason",
    "run_claim",
    "run_claim_next",
    "runs_release_reservation",
    "run_compensate",
    "run_compensation_done",
    "run_complete",
    "run_release",
    "run_resume",
    "run_review",
    "run_start",
    "run_start_claimed",
    "run_start_many",
    "Started",
    "run_terminate",
    "run_version",
    "run_wait",
    "runs_dispatch",
    "step_await_settle",
    "step_begin",
    "step_defer_check",
    "step_defer_reconcile",
    "step_enqueue",
    "step_fail",
    "step_mark_unknown",
    "step_reconcile",
    "step_refuse",
    "step_reset",
    "step_resolve",
    "step_retry",
    "step_retry_now",
    "step_reset_attempts",
    "step_succeed",
    "sweeper_beat",
    "executor_beat",
    "executor_register",
    "executor_stop",
    "executors_prune",
]

check_complete()  # every operator action has the transition that performs it
