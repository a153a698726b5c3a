"""How many runs are in each state and stuck for each cause: the one source of these numbers
for the console's chips, the dashboard and the metrics' gauges (recovery.observability).

Every count is capped (COUNT_CAP): a number above it reads "10,000+" in the console and is
reported as COUNT_CAP by the metrics, so no page or scrape counts a million rows."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib.postgres.expressions import ArraySubquery
from django.db import connections
from django.db.models import BooleanField, Count, ExpressionWrapper, F, Func, Min, Q, QuerySet

from recovery import executors, registry
from recovery.errors import ErrorKind
from recovery.models import (
    AGENT_STOPPED,
    IN_PROGRESS_RUN_STATES,
    TERMINAL_RUN_STATES,
    ApprovalRequest,
    ApprovalState,
    OutboxMessage,
    OutboxState,
    RunState,
    StepExecution,
    StepState,
    WorkflowRun,
)
from recovery.states import STUCK_LABELS as STUCK_LABELS  # re-exported: cause -> label, in the console's order
from recovery.states import StuckCause
from recovery.workflow import metric_label

COUNT_CAP = 10_000  # counts above this read "10,000+": no full COUNT(*) over a big table per request


def runs_among(run_ids: QuerySet) -> Q:
    """Runs whose id ``run_ids`` (a query of a few ids) returns. On PostgreSQL as ``id =
    ANY(ARRAY(…))``: the ids are read once and looked up by primary key, where ``IN (…)``
    becomes a semi join that walks the runs newest first until enough match (a million runs:
    73,000 rows read, 260 ms, to list the 51 newest of 800 runs with an unknown outcome)."""
    if connections[run_ids.db].vendor != "postgresql":
        return Q(pk__in=run_ids)
    any_of = Func(
        F("pk"),
        ArraySubquery(run_ids.order_by()),
        template="%(expressions)s)",
        arg_joiner=" = ANY(",
        output_field=BooleanField(),
    )
    return Q(any_of)


def stuck_causes(now: datetime) -> dict[str, tuple[str, Q]]:
    """Each stuck cause (recovery.states.StuckCause, in its order): its label and the runs it
    finds. Stuck means a person must act, or something is wrong. Causes found on steps are looked up
    from the steps' side (an index on state), so that a cause with few runs costs few rows, not
    a scan of every run; those of a rare run state start from the runs of that state."""

    def runs_with(**step_filter: Any) -> Q:
        return Q(pk__in=StepExecution.objects.filter(**step_filter).values("run_id"))

    def any_run_with(**step_filter: Any) -> Q:  # for a cause not narrowed by the run's state
        return runs_among(StepExecution.objects.filter(**step_filter).values("run_id"))

    # An operator stopped its agent: the run is held for that, whatever its journal's rows say
    # (a tool call that failed and waited for its retry is not retries exhausted).
    stopped = Q(state=RunState.NEEDS_REVIEW) & runs_with(state=StepState.PENDING, refusal__rule=AGENT_STOPPED)

    found = {
        StuckCause.NEEDS_REVIEW: Q(state=RunState.NEEDS_REVIEW),
        # An unknown outcome the engine is not already about to look up again (a paused run's is
        # looked up once an operator unpauses it: they know).
        StuckCause.UNKNOWN: (
            any_run_with(state=StepState.UNKNOWN)
            & ~Q(state=RunState.WAITING, next_wake_at__gt=now)
            & ~Q(state=RunState.PAUSED)
        ),
        # Another executor may take it over: not while it is reserved for its owner (the demo's
        # seed plays its runs on a past clock, their leases "expired" hours ago, held all the same).
        StuckCause.LEASE_EXPIRED: (
            Q(state=RunState.RUNNING, lease_expires_at__lt=now)
            & (Q(reserved_for__isnull=True) | Q(reserved_until__isnull=True) | Q(reserved_until__lte=now))
        ),
        StuckCause.EXHAUSTED: (
            Q(state=RunState.NEEDS_REVIEW)
            & runs_with(state=StepState.FAILED, last_error_kind__in=[ErrorKind.TRANSIENT, ErrorKind.RATE_LIMITED])
            & ~stopped
        ),
        StuckCause.AGENT_STOPPED: stopped,
        StuckCause.FAILED_WITH_EFFECTS: Q(state=RunState.FAILED, effects_stand=True),
        StuckCause.COMPENSATION_FAILED: Q(state=RunState.COMPENSATION_FAILED),
        StuckCause.POLICY_REFUSED: (
            Q(state=RunState.NEEDS_REVIEW)
            & runs_with(state=StepState.PENDING, last_error_kind=ErrorKind.POLICY_REFUSED)
            & ~stopped
        ),
        StuckCause.MODEL_OUTPUT: (
            Q(state=RunState.NEEDS_REVIEW)
            & runs_with(state=StepState.FAILED, last_error_kind=ErrorKind.INVALID_MODEL_OUTPUT)
            & ~stopped
        ),
        StuckCause.MESSAGE_UNDELIVERED: runs_among(
            OutboxMessage.objects.filter(state=OutboxState.FAILED).values("run_id")
        ),
        # A four-eyes request; a tool call held for a person past its deadline: escalated, or in review.
        StuckCause.APPROVAL: runs_among(ApprovalRequest.objects.filter(state=ApprovalState.PENDING).values("run_id"))
        | any_run_with(state=StepState.WAITING, approval__has_key="escalated_at")
        | runs_with(state=StepState.FAILED, approval__has_key="timed_out_at"),
        # A run that would go on, but whose (name, version) this deployment lacks: no executor here
        # claims it (recovery.registry). It waits in its state for its version, or to be moved.
        StuckCause.VERSION_NOT_DEPLOYED: Q(state__in=IN_PROGRESS_RUN_STATES) & ~registry.deployed_filter(),
        # Due (or its lease expired) longer than RECOVERY_EXECUTOR_SILENT_SECONDS ago, unclaimed,
        # and no executor is live (recovery.executors): nothing will move it until one starts.
        StuckCause.NO_EXECUTOR: executors.unclaimed(now) & registry.deployed_filter() & executors.none_live(now),
    }
    return {str(cause): (cause.label, found[cause]) for cause in StuckCause}


def capped_counts(querysets: list[QuerySet]) -> list[tuple[int, bool]]:
    """How many rows each queryset has, counting no further than COUNT_CAP: in one query (one
    scalar subquery per count, each reading at most COUNT_CAP + 1 rows of its own index)."""
    if not querysets:
        return []
    parts, params = [], []
    for i, qs in enumerate(querysets):
        sql, sub_params = qs.values("pk")[: COUNT_CAP + 1].query.sql_with_params()
        parts.append(f"(SELECT COUNT(*) FROM ({sql}) AS capped_{i})")
        params.extend(sub_params)
    with connections[querysets[0].db].cursor() as cursor:
        cursor.execute(f"SELECT {', '.join(parts)}", params)
        row = cursor.fetchone()
    return [(min(n, COUNT_CAP), n > COUNT_CAP) for n in row]


# The runs list's states: the run states, and after "Completed" the completed runs some of whose
# effects were undone since (a step compensated on its own), as their page and row say.
PARTLY_COMPENSATED = "partly_compensated"


def list_states() -> dict[str, str]:
    """The runs list's state filters, value → label, in the order of the chips."""
    found: dict[str, str] = {}
    for state in RunState:
        found[state.value] = state.label
        if state == RunState.COMPLETED:
            found[PARTLY_COMPENSATED] = "Completed, partly compensated"
    return found


def state_filter(state: str) -> Q:
    """The runs of a list state (``list_states``)."""
    if state == PARTLY_COMPENSATED:
        compensated = StepExecution.objects.filter(state=StepState.COMPENSATED).values("run_id")
        return Q(state=RunState.COMPLETED, pk__in=compensated)
    return Q(state=state)


def state_counts() -> list[dict[str, Any]]:
    states = list_states()
    counts = capped_counts([WorkflowRun.objects.filter(state_filter(state)) for state in states])
    return [
        {"state": state, "label": label, "count": n, "capped": capped}
        for (state, label), (n, capped) in zip(states.items(), counts, strict=True)
    ]


def stuck_counts(*, now: datetime, states: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Runs per stuck cause. A cause that is just a state (needs review, compensation failed)
    takes its number from ``states`` (``state_counts()``) when given, rather than counting it
    twice in one request."""
    known = {c["state"]: (c["count"], c["capped"]) for c in states or []}
    causes = stuck_causes(now)
    to_count = [key for key, (_, cond) in causes.items() if _state_only(cond) not in known]
    counted = dict(
        zip(to_count, capped_counts([WorkflowRun.objects.filter(causes[k][1]) for k in to_count]), strict=True)
    )
    return [
        {"cause": key, "label": label, "count": n, "capped": capped}
        for key, (label, cond) in causes.items()
        for n, capped in [counted[key] if key in counted else known[_state_only(cond)]]
    ]


def workflow_names(registered: list[str]) -> list[str]:
    """The workflows whose runs are counted per workflow (``/metrics``, the dashboard, the runs
    list's filter): the ``registered`` ones, then, each once, the names of runs whose workflow is
    no longer registered (renamed or removed by a deploy: their runs keep the old name and may
    still be stuck). One statement reading one index entry per name (``run_workflow_state_idx``:
    the smallest name, then the smallest one after it, …), never every run."""
    table = WorkflowRun._meta.db_table
    with connections[WorkflowRun.objects.db].cursor() as cursor:
        cursor.execute(
            f"""WITH RECURSIVE names(name) AS (
                    SELECT MIN(workflow_name) FROM {table}
                    UNION ALL
                    SELECT (SELECT MIN(workflow_name) FROM {table} WHERE workflow_name > names.name)
                    FROM names WHERE names.name IS NOT NULL
                )
                SELECT name FROM names WHERE name IS NOT NULL"""
        )
        found = [name for (name,) in cursor.fetchall()]
    known = set(registered)
    return list(registered) + [name for name in found if name not in known]


def by_workflow(workflows: list[str], *, now: datetime) -> dict[str, dict[tuple[str, str], tuple[int, bool]]]:
    """Runs by (workflow, state) and stuck runs by (workflow, cause), each capped, in one
    statement: ``{"states": {(workflow, state): (n, capped)}, "stuck": {(workflow, cause): …}}``.
    Each count reads one index range of ``run_workflow_state_idx`` (or a cause's few ids); a
    cause that is just a state takes that state's number."""
    causes = stuck_causes(now)
    counted = [key for key, (_, cond) in causes.items() if _state_only(cond) is None]
    keys: list[tuple[str, str, str]] = []
    querysets = []
    for name in workflows:
        runs = WorkflowRun.objects.filter(workflow_name=name)
        for state in RunState:
            keys.append(("states", name, state.value))
            querysets.append(runs.filter(state=state))
        for cause in counted:
            keys.append(("stuck", name, cause))
            querysets.append(runs.filter(causes[cause][1]))
    found: dict[str, dict[tuple[str, str], tuple[int, bool]]] = {"states": {}, "stuck": {}}
    for (kind, name, label), count in zip(keys, capped_counts(querysets), strict=True):
        found[kind][(name, label)] = count
    for name in workflows:
        for cause, (_, cond) in causes.items():
            state = _state_only(cond)
            if state is not None:
                found["stuck"][(name, cause)] = found["states"][(name, state)]
    return found


# Runs not finished hold their version: it must stay deployed (or they be moved) until they end.
UNFINISHED = [s for s in RunState if s not in TERMINAL_RUN_STATES]


def unfinished_by_version() -> list[dict[str, Any]]:
    """Runs not finished, per (workflow, version), by name then version: ``{"workflow", "version",
    "runs", "oldest"}`` (when the oldest of them started). A version with none is safe to remove
    from the code; one with some strands them if it goes. One statement over the unfinished runs."""
    rows = (
        WorkflowRun.objects.filter(state__in=UNFINISHED)
        .values("workflow_name", "workflow_version")
        .annotate(runs=Count("pk"), oldest=Min("created_at"))
        .order_by("workflow_name", "workflow_version")
    )
    return [
        {"workflow": r["workflow_name"], "version": r["workflow_version"], "runs": r["runs"], "oldest": r["oldest"]}
        for r in rows
    ]


def oldest_undelivered(now: datetime) -> float:
    """Seconds since the oldest outbox message not yet delivered (pending, or failed and waiting
    for an operator) was written; 0 when every message is delivered. Reads the undelivered
    messages only (outbox_due_idx starts with the state)."""
    oldest = OutboxMessage.objects.filter(state__in=[OutboxState.PENDING, OutboxState.FAILED]).aggregate(
        at=Min("created_at")
    )["at"]
    return max(0.0, (now - oldest).total_seconds()) if oldest is not None else 0.0


def waiting_steps() -> dict[tuple[str, str, str], int]:
    """(workflow, wait step or tool, cause) → the waits under way (steps ``waiting``;
    step_state_kind_idx): cause ``wait`` for a wait step (an event, a time), ``approval`` for a
    tool call held for a person (labelled by its tool, not its journal row)."""
    rows = (
        StepExecution.objects.filter(state=StepState.WAITING)
        .exclude(run__state__in=TERMINAL_RUN_STATES)  # a run terminated at a wait waits no more
        .annotate(held=ExpressionWrapper(Q(approval__isnull=False), output_field=BooleanField()))
        .values_list("run__workflow_name", "step_name", "held")
        .annotate(n=Count("id"))
    )
    found: dict[tuple[str, str, str], int] = {}
    for workflow, step, held, n in rows:
        key = (workflow, metric_label(step), "approval" if held else "wait")
        found[key] = found.get(key, 0) + n
    return found


def _state_only(cond: Q) -> str | None:
    """The state of a condition that is exactly ``Q(state=…)``, else None."""
    if not cond.negated and len(cond.children) == 1 and isinstance(cond.children[0], tuple):
        name, value = cond.children[0]
        if name == "state":
            return value
    return None
