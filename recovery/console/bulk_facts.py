"""What a bulk dry run says of each run beside its verdict: its state, why it is stuck (the runs
list's causes, recovery.counts.stuck_causes) and the effects it made elsewhere that will stand
after the action (a writing step that succeeded, with its remote reference; no bulk action
undoes any: recovery.actions.BULK_ACTIONS): what an operator must know before terminating a
hundred runs at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import Value

from recovery import counts
from recovery.console import labels
from recovery.models import RunState, StepExecution, StepState, WorkflowRun
from recovery.workflow import workflow_of


@dataclass(frozen=True)
class RunFacts:
    state: str  # the state as the runs list reads it ("Failed", "Completed, partly compensated")
    causes: list[str] = field(default_factory=list)  # stuck causes' labels, in the stuck chips' order
    stand: list[str] = field(default_factory=list)  # "create_task: task_12", effects that stay made

    @property
    def standing(self) -> str:
        """ "task_12 and msg_3 stay made", "" when none."""
        refs = [s.partition(": ")[2] for s in self.stand]
        if not refs:
            return ""
        joined = refs[0] if len(refs) == 1 else f"{', '.join(refs[:-1])} and {refs[-1]}"
        return f"{joined} stay{'s' if len(refs) == 1 else ''} made"


def facts(runs: list[WorkflowRun], steps: dict[int, list[StepExecution]], *, now: datetime) -> dict[str, RunFacts]:
    """Per workflow id of ``runs`` (their ``steps`` already read): its facts. One query for the
    stuck causes of them all (one arm per cause, in a UNION), none more."""
    causes = causes_of([r.pk for r in runs], now=now)
    found = {}
    for run in runs:
        try:
            workflow = workflow_of(run)
        except LookupError:
            workflow = None
        own = steps.get(run.pk, [])
        run.partly_compensated = run.state == RunState.COMPLETED and any(s.state == StepState.COMPENSATED for s in own)
        stand = []
        for step in sorted(own, key=lambda s: (s.position, s.pk)):
            if step.state != StepState.SUCCEEDED or not step.remote_ref:
                continue
            if workflow is not None and not workflow.writes(step.step_name):
                continue
            stand.append(f"{step.step_name}: {step.remote_ref}")
        found[run.workflow_id] = RunFacts(state=labels.list_state(run)[0], causes=causes.get(run.pk, []), stand=stand)
    return found


def causes_of(run_ids: list[int], *, now: datetime) -> dict[int, list[str]]:
    """The stuck causes' labels of each of ``run_ids`` (in stuck_causes' order), in one query."""
    if not run_ids:
        return {}
    runs = WorkflowRun.objects.filter(pk__in=run_ids)
    arms = [
        runs.filter(condition).annotate(cause=Value(key)).values_list("pk", "cause")
        for key, (_, condition) in counts.stuck_causes(now).items()
    ]
    found: dict[int, set[str]] = {}
    for pk, cause in arms[0].union(*arms[1:], all=True):
        found.setdefault(pk, set()).add(cause)
    return {pk: [label for key, label in counts.STUCK_LABELS.items() if key in keys] for pk, keys in found.items()}
