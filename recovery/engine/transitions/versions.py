"""Moving a run to another version of its workflow: whether the target can continue the run
(``move_plan``, pure: the transition, the dry runs, ``check_deploy`` and the console all ask it),
and the audited move itself (``run_move_version``).

A target can continue a run when every step the run has begun exists in the target with the
same name and position (so no new step lands before one that ran), the same key version (keys
never change by a move; a finished step whose key version changed keeps its effect only if the
operator says it stands) and, for a model step, a decision that still fits the target's schema.
Steps not begun are free: the target's own list replaces them (added, removed, new keys).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pydantic
from django.contrib.auth.models import AbstractBaseUser

from recovery import registry
from recovery.errors import InvalidTransition
from recovery.models import DecisionState, ModelDecision, RunState, StepExecution, StepState, WorkflowRun
from recovery.redaction import redact_text
from recovery.workflow import (
    StepSpec,
    Workflow,
    idempotency_key,
    is_journal_name,
    journal_rows,
    parse_journal_name,
)

from . import offers
from ._core import (
    _check,
    _redacted,
    _save_step,
    _snap,
)
from .acting import acting
from .performers import performs
from .runs import new_step
from .tables import DONE_STEP_STATES, RUN_TRANSITIONS

# A step in these states holds a known outcome (its effect made, undone, or left out).
_FINISHED = DONE_STEP_STATES | offers.UNDONE_STEP_STATES


@dataclass
class MovePlan:
    """What moving a run to ``target`` would do, or why it cannot (``refusal``, naming the first
    incompatible step in ``step``)."""

    source: int
    target: int
    refusal: str = ""
    step: str = ""
    added: list[str] = field(default_factory=list)  # steps the target adds (rows inserted, pending)
    removed: list[str] = field(default_factory=list)  # steps not begun that the target lacks (rows removed)
    rekeyed: list[str] = field(default_factory=list)  # steps not begun (or known failed): the target's key version
    # Finished steps whose key version the target changes: their effect (remote reference) was made
    # under the old key; the move keeps it only when the operator says that it stands.
    effects: list[dict[str, Any]] = field(default_factory=list)
    # Model steps whose accepted decision the target's declared migration turns into one of its schema
    migrated: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.refusal

    def summary(self) -> str:
        """One line: compatible and what changes, or why not."""
        if not self.ok:
            return self.refusal
        changes = [
            f"adds {', '.join(self.added)}" if self.added else "",
            f"drops {', '.join(self.removed)}" if self.removed else "",
            f"new keys for {', '.join(self.rekeyed)}" if self.rekeyed else "",
            f"effects made under an old key: {', '.join(e['step'] for e in self.effects)}" if self.effects else "",
            f"migrates the decision of {', '.join(self.migrated)}" if self.migrated else "",
        ]
        said = "; ".join(c for c in changes if c)
        return f"can move to v{self.target}" + (f" ({said})" if said else "")

    def refuse(self, step: str, why: str) -> MovePlan:
        self.step, self.refusal = step, f"cannot move to v{self.target}: {why}"
        return self


def drift(rows: list[StepExecution], workflow: Workflow) -> str:
    """Why the definition the run executes on no longer matches the steps its checkpoints were
    written for ("" when it does): a deploy changed the steps of a version without bumping it.
    The run must not go on against another list (a new step would be skipped, a removed one
    would be found missing halfway); a new version, and a move, is the way."""
    had = [(r.step_name, r.position) for r in sorted(rows, key=lambda r: r.order) if not is_journal_name(r.step_name)]
    declared = [(s.name, s.position) for s in workflow.steps]
    if had == declared:
        return ""
    first = next(
        (i for i, (a, b) in enumerate(zip(had, declared, strict=False)) if a != b), min(len(had), len(declared))
    )
    ran = had[first][0] if first < len(had) else "(none)"
    now = declared[first][0] if first < len(declared) else "(none)"
    return (
        f"the steps of {workflow.name} v{workflow.version} changed under this run without a new version: "
        f"step {first + 1} is {ran} in its checkpoints and {now} in the code deployed; declare the change as a new "
        "version (keep this one beside it), or move the run"
    )


def continuation(
    run: WorkflowRun, rows: list[StepExecution], workflow: Workflow, decisions: dict[str, ModelDecision]
) -> list[str]:
    """Why ``workflow`` (the definition of the run's own version in some code) could not continue
    the run from these checkpoints (none: it can): its step list, and for each step begun its key
    version, its agent's tools and its accepted decision against today's schema; and every key
    as the code would derive it. What a replay before a deploy checks (recovery.replay)."""
    problems = [changed] if (changed := drift(rows, workflow)) else []
    names = {s.name: s for s in workflow.steps}
    scratch = MovePlan(source=run.workflow_version, target=workflow.version)
    for row in sorted(rows, key=lambda r: r.order):
        if row.idempotency_key != idempotency_key(run.workflow_id, row.step_name, row.key_version):
            problems.append(f"{row.step_name}: its key is not the one this code derives for its key version")
        if is_journal_name(row.step_name) or not _begun(row) or row.step_name not in names:
            continue
        why = _incompatible(row, names[row.step_name], workflow, rows, decisions, scratch)
        if why:
            problems.append(why)
    problems += [
        f"{e['step']}: made under key version {e['key_version']}; this code declares {e['to']} for it"
        for e in scratch.effects
    ]
    problems += [
        f"{name}: its decision's schema changed under this run without a new version" for name in scratch.migrated
    ]
    return problems


def declared(row: StepExecution) -> int:
    """The key version the step's declaration gave the row: its own, less the restarts that made
    it again under a new one (recovery.engine.transitions.restarts)."""
    return row.key_version - (row.restarts or 0)


def _begun(row: StepExecution) -> bool:
    """Whether anything was sent for the step: a guard's refusal, or a deferred check, sent nothing."""
    return row.state != StepState.PENDING or row.attempts > 0


def move_plan(
    run: WorkflowRun, rows: list[StepExecution], target: Workflow, decisions: dict[str, ModelDecision]
) -> MovePlan:
    """Whether ``target`` (a version of the run's workflow) can continue the run as its rows
    stand, and what moving it there changes. ``decisions``: the run's accepted decisions by step.
    Pure: reads only what it is given."""
    plan = MovePlan(source=run.workflow_version, target=target.version)
    if target.name != run.workflow_name:
        return plan.refuse("", f"{target.name} is another workflow than {run.workflow_name}")
    if target.version == run.workflow_version:
        return plan.refuse("", f"the run is on v{target.version} already")
    steps = sorted((r for r in rows if not is_journal_name(r.step_name)), key=lambda r: r.order)
    names = {s.name: s for s in target.steps}
    for row in steps:
        spec = names.get(row.step_name)
        if not _begun(row):
            if spec is None:
                plan.removed.append(row.step_name)
            elif spec.key_version != declared(row):
                plan.rekeyed.append(row.step_name)
            continue
        why = _incompatible(row, spec, target, rows, decisions, plan)
        if why:
            return plan.refuse(row.step_name, why)
    had = {r.step_name for r in steps}
    plan.added = [s.name for s in target.steps if s.name not in had]
    return plan


def _incompatible(
    row: StepExecution,
    spec: StepSpec | None,
    target: Workflow,
    rows: list[StepExecution],
    decisions: dict[str, ModelDecision],
    plan: MovePlan,
) -> str:
    """Why a step the run has begun stops ``target`` from continuing it ("" if nothing does)."""
    name, v = row.step_name, target.version
    if spec is None:
        return f"{name} ({row.state}) is not a step of v{v}"
    if spec.position != row.position:
        return (
            f"{name} is step {row.position + 1} of this run and step {spec.position + 1} of v{v}: "
            "the steps before it differ"
        )
    if spec.is_agent:
        return _agent_incompatible(row, spec, rows, v)
    if spec.key_version != declared(row):
        if row.state in _FINISHED:
            plan.effects.append(
                {"step": name, "remote_ref": row.remote_ref, "key_version": row.key_version, "to": spec.key_version}
            )
        elif row.state == StepState.FAILED:
            plan.rekeyed.append(name)  # a known failure made nothing: the next attempt may carry the new key
        else:
            return (
                f"{name} was attempted under key version {row.key_version} and has key version {spec.key_version} "
                f"in v{v}, and its outcome is {row.state}: settle it first (reconcile, or resolve it), then move"
            )
    if spec.is_decision and row.state == StepState.SUCCEEDED:
        return _decision_incompatible(name, spec, decisions.get(name), v, plan)
    return ""


def _decision_incompatible(name: str, spec: StepSpec, decision: ModelDecision | None, v: int, plan: MovePlan) -> str:
    """Whether the accepted decision fits the target's schema, through the migrations the target
    declares from its schema version (the migrated decision goes in ``plan.migrated``)."""
    if decision is None:
        return ""
    schema = spec.decision_schema
    assert schema is not None
    accepted, had = decision.accepted, decision.schema_version
    if had > spec.schema_version:
        return f"{name}'s accepted decision was made under schema v{had}, newer than v{v}'s v{spec.schema_version}"
    for k in range(had, spec.schema_version):
        migrate = spec.decision_migrations.get(k)
        if migrate is None:
            return (
                f"{name}'s accepted decision was made under schema v{had}; v{v} declares {schema.__name__} "
                f"v{spec.schema_version} and no migration from v{k}"
            )
        try:
            accepted = migrate(copy.deepcopy(accepted))
        except Exception as exc:
            return f"{name}: v{v}'s migration of its decision from schema v{k} failed: {type(exc).__name__}: {exc}"
    try:
        validated = schema.model_validate(accepted).model_dump(mode="json")
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"])) or "decision"
        return f"{name}'s accepted decision does not fit v{v}'s {schema.__name__} ({where}: {first['msg']})"
    if had != spec.schema_version:
        plan.migrated[name] = validated
    return ""


def _agent_incompatible(row: StepExecution, spec: StepSpec, rows: list[StepExecution], v: int) -> str:
    """An agent begun: every call its journal holds names a tool of the target's agent, under
    the same key versions (the agent's forks add to each tool's)."""
    assert spec.agent is not None
    forks = row.key_version - spec.key_version
    if forks < 0:
        return f"{row.step_name} has key version {row.key_version}, below v{v}'s {spec.key_version}"
    for entry in journal_rows(row.step_name, rows):
        tool_name = parse_journal_name(entry.step_name).tool
        if tool_name is None:
            continue
        tool = spec.agent.tools.get(tool_name)
        if tool is None:
            return f"{entry.step_name} called the tool {tool_name}, which v{v}'s {row.step_name} does not have"
        if tool.key_version + forks != entry.key_version:
            expected = tool.key_version + forks
            return f"{entry.step_name} was made under key version {entry.key_version}; v{v} gives it {expected}"
    return ""


def accepted_decisions(run: WorkflowRun) -> dict[str, ModelDecision]:
    """The run's accepted decisions by step: what ``move_plan`` checks against a target's schemas."""
    return accepted_by_run([run.pk]).get(run.pk, {})


def accepted_by_run(run_pks: list[int]) -> dict[int, dict[str, ModelDecision]]:
    """``accepted_decisions`` of many runs, in one query (a dry run of many moves)."""
    found: dict[int, dict[str, ModelDecision]] = {}
    for decision in ModelDecision.objects.filter(run_id__in=run_pks, state=DecisionState.ACCEPTED):
        found.setdefault(decision.run_id, {})[decision.step_name] = decision
    return found


@performs("move_version", offered=offers.movable)
def run_move_version(
    *,
    workflow_id: str,
    actor: AbstractBaseUser | None,
    reason: str,
    version: int | None,
    effects_stand: bool = False,
    expect: str | None = None,
    now: datetime | None = None,
    approval: Any = None,
) -> WorkflowRun:
    """Move a stopped run to another registered version of its workflow, when that version can
    continue it (``move_plan``); otherwise refuse, naming the first incompatible step. Steps the
    run has begun keep their rows, keys and outcomes; the target's list replaces the steps not
    begun. A finished step whose key version the target changes keeps its effect (and its old
    key) only with ``effects_stand``: the operator says the effect made under the old key stands.
    A run that would go on by itself is due at once; one in review or failed stays so (resume it)."""
    with acting(
        "move_version", workflow_id=workflow_id, actor=actor, reason=reason, expect=expect, now=now, approval=approval
    ) as act:
        run, now = act.run, act.now
        abandoned = act.abandon_running()  # an expired executor's call: unknown
        act.before = {**_snap(run), "version": run.workflow_version}
        target, plan = planned_move(run, act.situation.steps, version, effects_stand)
        rows = act.situation.steps
        _apply(run, rows, target, plan, now, actor)
        _migrate_decisions(run, rows, target, plan, act.reason, now, actor)
        run.workflow_version = target.version
        if run.state not in (RunState.NEEDS_REVIEW, RunState.FAILED):  # those wait for an operator's resume
            _check(RUN_TRANSITIONS, "move_version", run.state, "run")
            # fence out the executor whose lease expired, should it wake
            act.release(
                RunState.PENDING,
                f"moved from v{plan.source} to v{plan.target}",
                fence=True,
                fields=("workflow_version",),
            )
        else:
            act.save_run(["workflow_version"])
        act.after = {**_snap(run), "version": target.version}
        for key, value in (
            ("steps_added", plan.added),
            ("steps_removed", plan.removed),
            ("keys_changed", plan.rekeyed),
            ("effects_stand", plan.effects),
            ("decisions_migrated", sorted(plan.migrated)),
            ("steps_now_unknown", abandoned),
        ):
            if value:
                act.after[key] = value
        return run


def planned_move(
    run: WorkflowRun, rows: list[StepExecution], version: int | None, effects_stand: bool
) -> tuple[Workflow, MovePlan]:
    """The version the run moves to and how (``move_plan``), or the InvalidTransition that
    refuses the move: the transition's judgement, and a four-eyes request's before it waits."""
    if version is None:
        raise InvalidTransition("move_version needs the version to move the run to")
    try:
        target = registry.get_workflow(run.workflow_name, version)
    except LookupError as exc:
        raise InvalidTransition(str(exc)) from None
    plan = move_plan(run, rows, target, accepted_decisions(run))
    if not plan.ok:
        raise InvalidTransition(plan.refusal)
    if plan.effects and not effects_stand:
        made = "; ".join(f"{e['step']}: {e['remote_ref'] or 'no remote reference'}" for e in plan.effects)
        raise InvalidTransition(
            f"v{plan.target} gives {', '.join(e['step'] for e in plan.effects)} a new key version, and the "
            f"run made its effect under the old key ({made}): say whether that effect stands (effects stand), "
            "or compensate it first"
        )
    return target, plan


def _apply(
    run: WorkflowRun,
    rows: list[StepExecution],
    target: Workflow,
    plan: MovePlan,
    now: datetime,
    actor: AbstractBaseUser | None,
) -> None:
    """The target's step list over the run's rows: begun rows kept as they are, the others moved
    to the target's position and key version; rows of steps it lacks removed; its new steps added."""
    by_name = {r.step_name: r for r in rows}
    for name in plan.removed:
        by_name.pop(name).delete()
    for spec in target.steps:
        row = by_name.get(spec.name)
        if row is None:
            new_step(run, spec, now).save(force_insert=True)
            continue
        changed = []
        if row.position != spec.position:
            row.position = spec.position
            changed.append("position")
        if spec.name in plan.rekeyed:
            row.key_version = spec.key_version + (row.restarts or 0)
            row.idempotency_key = idempotency_key(run.workflow_id, spec.name, row.key_version)
            changed += ["key_version", "idempotency_key"]
        if changed:
            _save_step(row, changed, now, actor)


def _migrate_decisions(
    run: WorkflowRun,
    rows: list[StepExecution],
    target: Workflow,
    plan: MovePlan,
    reason: str,
    now: datetime,
    actor: AbstractBaseUser | None,
) -> None:
    """Each decision the target migrates becomes a new accepted version of it under the target's
    schema (the old one superseded, with why); its step's result follows, as a supersede's does."""
    by_name = {r.step_name: r for r in rows}
    for name, migrated in plan.migrated.items():
        old = ModelDecision.objects.select_for_update().get(run=run, step_name=name, state=DecisionState.ACCEPTED)
        spec = target.get_step(name)
        old.state = DecisionState.SUPERSEDED
        old.superseded_reason = redact_text(
            f"migrated to schema v{spec.schema_version} by a move to v{target.version}: {reason}"
        )
        old.save(update_fields=["state", "superseded_reason"])
        accepted = _redacted(run, migrated)
        ModelDecision.objects.create(
            run=run,
            step_name=name,
            version=old.version + 1,
            state=DecisionState.ACCEPTED,
            schema_version=spec.schema_version,
            proposal=None,
            accepted=accepted,
            created_at=now,
        )
        step = by_name[name]
        step.result = accepted
        step.remote_ref = f"decision v{old.version + 1}"
        _save_step(step, ["result", "remote_ref"], now, actor)
