"""What restarting a run from one of its steps with a corrected input (or a corrected intent of
that step) would do, judged before anything is written: the correction checked like an API
request (the workflow's schema, the run's identity), the difference, and what becomes of each
effect from that step on — the one-effect rule stated before a supervisor confirms:

- an effect not undone yet is undone first by its compensation, then made again under a new key;
- an effect undone already is made again under a new key;
- where the step declares it (``second_effect``) and the supervisor lets it (``effects_stand``),
  the first effect stands and a second one is made under a new key, in the step's own words;
- anything else is refused: an effect is never made twice silently.

Pure: reads the run, its steps and the workflow's declaration, and writes nothing.
(recovery.engine.transitions.restarts writes what it plans.)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import pydantic

from recovery.errors import InvalidTransition
from recovery.models import RunState, StepState
from recovery.validation import one_line, problem_text, problems_of
from recovery.workflow import StepSpec, is_journal_name

from .offers import Situation
from .tables import DONE_STEP_STATES, RUN_TRANSITIONS

# What becomes of a step from the restart's step on (Effect.rule).
AGAIN = "again"  # nothing of it stands (a read, a model step, a known failure, never begun): made again
UNDO = "undo"  # its effect is undone first (its compensation), then made again under a new key
UNDONE = "undone"  # its effect was undone already: made again under a new key
STANDS = "stands"  # its effect stands; a second one is made under a new key (the step's second_effect)
KEPT = "kept"  # before the restart's step: kept as made from the input before the correction

EDITS = ("input", "intent")


@dataclass(frozen=True)
class Effect:
    step: str
    rule: str
    text: str
    remote_ref: str = ""
    key_version: int | None = None  # the key version it is made again under, where it gets a new one


@dataclass
class RestartPlan:
    step_name: str
    edited: str  # "input" or "intent"
    before: dict[str, Any]
    after: dict[str, Any]
    diff: list[dict[str, Any]]
    effects: list[Effect] = field(default_factory=list)

    @property
    def undo_first(self) -> list[str]:
        return [e.step for e in self.effects if e.rule == UNDO]

    def effects_json(self) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.effects]

    def lines(self) -> list[str]:
        """The difference, then what becomes of each step: what the console and ``recover restart
        --dry-run`` show before a supervisor confirms."""
        what = "the run's input" if self.edited == "input" else f"{self.step_name}'s intent"
        lines = [f"restart from {self.step_name}, {what} corrected:"]
        lines += [f"  {change_text(c)}" for c in self.diff]
        lines += [f"  {e.step}: {e.text}" for e in self.effects]
        return lines


def change_text(change: dict[str, Any]) -> str:
    """ "amount: "1200.00" → "1250.00" " """
    return f"{change['path']}: {_shown(change.get('before'))} → {_shown(change.get('after'))}"


def _shown(value: Any) -> str:
    text = "—" if value is None else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 200 else text[:199] + "…"


def diff(before: Any, after: Any, path: str = "") -> list[dict[str, Any]]:
    """Every leaf that differs between two JSON values, by its dotted path (objects are walked,
    anything else compared whole): [{"path", "before", "after"}]."""
    if isinstance(before, dict) and isinstance(after, dict):
        found = []
        for key in sorted({*before, *after}, key=str):
            where = f"{path}.{key}" if path else str(key)
            found += diff(before.get(key), after.get(key), where)
        return found
    return [] if before == after else [{"path": path or "(the whole value)", "before": before, "after": after}]


def corrected_intent(spec: StepSpec, built: dict[str, Any], correction: dict[str, Any]) -> dict[str, Any]:
    """The intent ``spec`` builds with a supervisor's corrected fields laid over it, checked:
    by the step's ``intent_schema`` where it declares one; else each corrected field must be one
    the intent has, with a value of the same JSON type. Raises InvalidTransition naming every
    problem, on one line."""
    merged = {**built, **correction}
    if spec.intent_schema is not None:
        try:
            return spec.intent_schema.model_validate(merged).model_dump(mode="json")
        except pydantic.ValidationError as exc:
            headline = f"the corrected intent does not match {spec.intent_schema.__name__}"
            raise InvalidTransition(one_line(problem_text(headline, problems_of(exc)))) from None
    problems = []
    for key, value in correction.items():
        if key not in built:
            problems.append(f"{key}: {spec.name}'s intent has no such field ({', '.join(sorted(built)) or 'none'})")
        elif _kind(value) != _kind(built[key]):
            problems.append(f"{key}: a {_kind(built[key])} is expected, not a {_kind(value)}")
    if problems:
        raise InvalidTransition(one_line(problem_text(f"the corrected intent of {spec.name} is refused", problems)))
    return merged


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "object"
    return "null"


# A run a restart may start from: one at rest. Not while it runs, is paused (why_not says so),
# compensates or failed to compensate (finish that first), nor once terminated (stopped for good).
RESTARTABLE_RUN_STATES = RUN_TRANSITIONS["restart"][0]


def restartable(s: Situation, step_name: str | None, actor) -> str:
    """Whether the run may restart from ``step_name`` now ("" if so): the run at rest and nobody
    holding it, every step before it done, nothing from it on in flight, unknown or being undone,
    and no agent begun from it on. What the correction is, and its effects, ``plan_restart`` judges."""
    run = s.run
    if run.state not in RESTARTABLE_RUN_STATES:
        if run.state == RunState.TERMINATED:
            return f"run {run.workflow_id} was terminated: it stays stopped (start the business event again)"
        return f"run {run.workflow_id} is {run.state}: finish that first (a restart starts from a run at rest)"
    if s.live:
        return f"run {run.workflow_id} is running under {run.lease_owner}; pause it or wait for it"
    if s.workflow is None:
        return f"{run.workflow_name} v{run.workflow_version} is not deployed: its steps cannot be made again"
    if is_journal_name(step_name or ""):
        return f"{step_name} is a turn of an agent: fork the agent from it instead"
    step = s.step(step_name)
    before = [o for o in s.steps if o.order < step.order and not is_journal_name(o.step_name)]
    if open_ := next((o for o in before if o.state not in DONE_STEP_STATES), None):
        return (
            f"{step_name} has not been reached: {open_.step_name} before it is {s.state_of(open_)} "
            "(restart from a step the run has reached)"
        )
    from_here = [o for o in s.steps if o.order >= step.order]
    if unknown := [o.step_name for o in from_here if s.state_of(o) in (StepState.UNKNOWN, StepState.RUNNING)]:
        return f"reconcile {', '.join(unknown)} first: its outcome is unknown"
    undoing = [o.step_name for o in from_here if o.state in (StepState.COMPENSATING, StepState.COMPENSATION_FAILED)]
    if undoing:
        return f"{', '.join(undoing)} is being compensated: finish that first"
    agents = [o.step_name for o in from_here if is_journal_name(o.step_name)]
    if agents:
        agent = agents[0].split(":", 1)[0]
        return f"the agent {agent} has begun from {step_name} on: a restart cannot remake its conversation (fork it)"
    return ""


def plan_restart(
    s: Situation,
    step_name: str,
    *,
    edited: str,
    value: Any,
    effects_stand: bool = False,
    check_input=None,
) -> RestartPlan:
    """What restarting the run from ``step_name`` — an action its caller found offered
    (``restartable``, through offers.why_not) — with ``value``, the corrected input
    (``edited="input"``, checked by ``check_input``: the workflow's schema and the run's id) or
    the step's corrected intent (``"intent"``, the fields to change) — would do; InvalidTransition
    when it may not (the refusal says why, and what to do instead)."""
    if edited not in EDITS:
        raise InvalidTransition("a restart corrects the run's input or the step's intent: give one of them")
    if not isinstance(value, dict):
        raise InvalidTransition(f"the corrected {edited} must be a JSON object")
    run, workflow = s.run, s.workflow
    spec = workflow.get_step(step_name)
    if edited == "input":
        before, after = dict(run.input), check_input(value)
    else:
        row = s.step(step_name)
        if not row.intent:
            raise InvalidTransition(
                f"{step_name} has no intent yet (it is built when the step runs): correct the run's input instead"
            )
        before = dict(row.intent)
        after = corrected_intent(spec, before, value)
    changes = diff(before, after)
    if not changes:
        raise InvalidTransition(f"the corrected {edited} is the same as the current one: nothing to restart with")
    plan = RestartPlan(step_name=step_name, edited=edited, before=before, after=after, diff=changes)
    start = s.step(step_name)
    if edited == "input":  # said, so that nobody expects an earlier step to read the corrected input
        kept = "kept as it is: made from the input before the correction (restart from it to make it again)"
        plan.effects += [Effect(o.step_name, KEPT, kept) for o in s.steps if o.order < start.order]
    for row in (o for o in s.steps if o.order >= start.order):
        plan.effects.append(_effect(s, row, workflow.get_step(row.step_name), effects_stand))
    return plan


def _effect(s: Situation, row, spec: StepSpec, effects_stand: bool) -> Effect:
    """What the restart makes of one step from its step on (the module's rules)."""
    name, ref = row.step_name, row.remote_ref
    again = row.key_version + 1
    if spec.asks_model:
        return Effect(name, AGAIN, "the model is asked again (its accepted decision is superseded)")
    if spec.wait is not None and not spec.wait.is_timer:
        event = spec.wait.event
        return Effect(name, AGAIN, f"waits again for event {event!r}: one sent before the restart is not used")
    if not spec.writes:
        return Effect(name, AGAIN, "made again (it has no effect elsewhere)")
    if row.state == StepState.COMPENSATED:
        undone = f" by {row.compensation_ref}" if row.compensation_ref else ""
        return Effect(name, UNDONE, f"{ref or 'its effect'} was undone{undone}; made again under a new key", ref, again)
    if row.state != StepState.SUCCEEDED:
        if row.attempts or row.request_hash:
            return Effect(
                name, AGAIN, f"made under a new key (its attempts so far changed nothing: {row.state})", "", again
            )
        return Effect(name, AGAIN, "not begun: made when the run reaches it")
    if spec.second_effect and (effects_stand or spec.compensation_fn is None):
        if not effects_stand:
            raise InvalidTransition(
                f"{name}: {ref or 'its effect'} cannot be undone and stands; confirm that it stands and a second one "
                f"is made ({spec.second_effect}) with --effects-stand"
            )
        return Effect(name, STANDS, f"{spec.second_effect} ({ref or 'its effect'} stands)", ref, again)
    if spec.compensation_fn is None:
        raise InvalidTransition(
            f"{name}: {ref or 'its effect'} ({spec.effect}) cannot be undone, and {s.run.workflow_name} declares no "
            f"second effect for it: restart from a later step, or start the business event again"
        )
    how = spec.compensation.description if spec.compensation else "its compensation"
    return Effect(
        name, UNDO, f"{ref or 'its effect'} is undone first ({how}), then made again under a new key", ref, again
    )
