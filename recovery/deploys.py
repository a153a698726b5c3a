"""What a deploy would strand: the unfinished runs whose (workflow, version) the code in this
process lacks, grouped by workflow, version and current step, each group with whether a move to
the workflow's current version here could continue its runs (``transitions.move_plan``).

``manage.py check_deploy`` runs it with the code about to be deployed against the production
database, before the deploy; ``manage.py check --database default`` warns with it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from recovery import clock, registry
from recovery.counts import UNFINISHED
from recovery.engine import transitions
from recovery.models import StepExecution, WorkflowRun

BATCH = 500  # runs judged per round of reads (their steps and decisions in one query each)


@dataclass
class Group:
    """Stranded runs of one workflow version at one step."""

    workflow: str
    version: int
    step: str  # the run's current step; "" before its first
    target: int | None  # the workflow's current version here; None: this code has no such workflow
    runs: int = 0
    movable: int = 0
    states: Counter = field(default_factory=Counter)
    oldest: datetime | None = None
    why_not: Counter = field(default_factory=Counter)  # refusal -> runs
    examples: list[str] = field(default_factory=list)  # a few workflow ids, to look at

    def verdict(self) -> str:
        if self.target is None:
            return f"this code has no {self.workflow} workflow: deploy it again, or terminate these runs"
        if self.movable == self.runs:
            return f"all can move to v{self.target}"
        reasons = "; ".join(f"{why} ({n})" for why, n in self.why_not.most_common(3))
        some = f"{self.movable} can move to v{self.target}, " if self.movable else ""
        return f"{some}{self.runs - self.movable} cannot: {reasons}"

    def as_json(self) -> dict[str, Any]:
        return {
            "workflow": self.workflow,
            "version": self.version,
            "step": self.step,
            "runs": self.runs,
            "states": dict(sorted(self.states.items())),
            "oldest": self.oldest.isoformat() if self.oldest else None,
            "target": self.target,
            "movable": self.movable,
            "why_not": dict(self.why_not.most_common()),
            "examples": self.examples,
        }


def stranded_runs(*, workflow: str | None = None):
    """The unfinished runs whose version this code lacks (a query, oldest first)."""
    runs = WorkflowRun.objects.filter(state__in=UNFINISHED).exclude(registry.deployed_filter())
    if workflow is not None:
        runs = runs.filter(workflow_name=workflow)
    return runs.order_by("pk")


def stranded(*, workflow: str | None = None) -> list[Group]:
    """Every stranded run, judged and grouped by (workflow, version, current step)."""
    groups: dict[tuple[str, int, str], Group] = {}
    for run, plan in judged(stranded_runs(workflow=workflow)):
        key = (run.workflow_name, run.workflow_version, run.current_step)
        group = groups.get(key)
        if group is None:
            target = registry.current_version(run.workflow_name)
            group = groups[key] = Group(*key, target=target)
        group.runs += 1
        group.states[run.state] += 1
        group.oldest = min(group.oldest or run.created_at, run.created_at)
        if len(group.examples) < 3:
            group.examples.append(run.workflow_id)
        if plan is not None and plan.ok:
            group.movable += 1
        elif plan is not None:
            group.why_not[plan.refusal] += 1
    return sorted(groups.values(), key=lambda g: (g.workflow, g.version, g.step))


def judged(runs) -> Any:
    """(run, its move plan to the current version here, or None when this code has no version of
    its workflow) for each run of ``runs``, reading steps and decisions BATCH runs at a time."""
    last = 0
    while True:
        batch = list(runs.filter(pk__gt=last)[:BATCH])
        if not batch:
            return
        last = batch[-1].pk
        rows: dict[int, list[StepExecution]] = {}
        for step in StepExecution.objects.filter(run_id__in=[r.pk for r in batch]):
            rows.setdefault(step.run_id, []).append(step)
        decisions = transitions.accepted_by_run([r.pk for r in batch])
        now = clock.now()
        for run in batch:
            current = registry.current_version(run.workflow_name)
            if current is None:
                yield run, None
                continue
            # The run's state, as the transition judges it (a compensation under way, a live lease)
            situation = transitions.Situation.of(run, rows.get(run.pk, []), now)
            if (refused := transitions.why_not("move_version", situation)) is not None:
                yield run, transitions.MovePlan(source=run.workflow_version, target=current).refuse("", str(refused))
                continue
            target = registry.get_workflow(run.workflow_name, current)
            yield run, transitions.move_plan(run, situation.steps, target, decisions.get(run.pk, {}))
