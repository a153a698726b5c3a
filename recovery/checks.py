"""System checks: ``manage.py check`` fails for a workflow whose recovery contract has holes, and
warns about a step that acts on a model's decision unguarded."""

from django.conf import settings
from django.core import checks
from django.db import DatabaseError

from recovery import deploys
from recovery.workflow import Reconcile, Rerun, StepSpec, ToolSpec, all_versions, get_workflow


@checks.register()
def check_recovery_contracts(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    for workflow in all_versions():  # an older version kept beside the current one runs runs too
        if not workflow.steps:
            errors.append(checks.Error(f"workflow {workflow.name!r} declares no steps", id="recovery.E001"))
        for spec in [*workflow.steps, *workflow.tools.values()]:  # a tool's contract is a step's
            where = f"{_name(workflow)}.{spec.name}"
            if spec.rerun != Rerun.YES and spec.reconcile is None:
                errors.append(
                    checks.Error(
                        f"{where} is not safe to re-run and has no unknown-outcome path",
                        hint="declare reconcile=Reconcile.LOOKUP (with a @step.lookup), RESEND or OPERATOR",
                        id="recovery.E002",
                    )
                )
            if spec.rerun == Rerun.NO and spec.reconcile == Reconcile.RERUN:
                errors.append(
                    checks.Error(
                        f"{where} is not safe to re-run, so an unknown outcome cannot be resolved by re-running it",
                        hint="declare reconcile=Reconcile.LOOKUP, RESEND or OPERATOR",
                        id="recovery.E003",
                    )
                )
            if spec.reconcile == Reconcile.LOOKUP and spec.lookup_fn is None:
                errors.append(
                    checks.Error(
                        f"{where} reconciles by look-up but declares no @{spec.name}.lookup function",
                        id="recovery.E004",
                    )
                )
            if spec.compensable and spec.compensation_fn is None:
                errors.append(
                    checks.Error(
                        f"{where} is declared compensable but has no compensation",
                        hint=f"declare @{spec.name}.compensate(description=..., who=...)",
                        id="recovery.E005",
                    )
                )
            if spec.outbox and spec.lookup_fn is None:
                errors.append(
                    checks.Error(
                        f"{where} is delivered through the outbox but declares no @{spec.name}.lookup",
                        hint="the publisher must find an earlier delivery before it sends again",
                        id="recovery.E006",
                    )
                )
            errors += _check_timing(where, spec)
            if workflow.acts_on_decision(spec) and not workflow.guards_for(spec):
                model_step = workflow.decision_before(spec)
                what = "an agent's model" if isinstance(spec, ToolSpec) else model_step.name if model_step else None
                errors.append(
                    checks.Warning(
                        f"{where} acts on the decision of {what or 'a model step'} "
                        "and declares no guard: whatever the model proposes is sent as it is",
                        hint=f"declare @{spec.name}.guard(rule) (or @{workflow.name}.guard) to check the decision "
                        "against your rules and the current state before anything is written",
                        id="recovery.W001",
                    )
                )
        known = {spec.name for spec in workflow.steps} | set(workflow.tools)
        for guard in workflow.guards:
            unknown = sorted(set(guard.steps or ()) - known)
            if unknown:
                errors.append(
                    checks.Error(
                        f"workflow {workflow.name!r}: guard {guard.rule} names no such step: {', '.join(unknown)}",
                        id="recovery.E009",
                    )
                )
    return errors


def _check_timing(where: str, spec: StepSpec) -> list[checks.CheckMessage]:
    """A call must end inside its executor's lease even if one heartbeat is missed, and its
    in-flight bound cannot be shorter than the time the caller itself waits."""
    errors: list[checks.CheckMessage] = []
    timeout = spec.call_timeout()
    lease, beat = settings.RECOVERY_LEASE_SECONDS, settings.RECOVERY_HEARTBEAT_SECONDS
    makes_call = spec.is_decision or spec.rerun != Rerun.YES or spec.timeout is not None
    if spec.local or not makes_call:
        return errors  # nothing in flight elsewhere: a repeatable read outliving a lease doubles nothing
    if timeout + beat > lease:
        errors.append(
            checks.Error(
                f"{where}: its call may take {timeout:g} s (its timeout) and the heartbeat renews the lease every "
                f"{beat:g} s: {timeout:g} + {beat:g} = {timeout + beat:g} s does not fit the lease of {lease:g} s "
                "(RECOVERY_LEASE_SECONDS)",
                hint="shorten the call's timeout (timeout=…, RECOVERY_HTTP_TIMEOUT, OPENAI_TIMEOUT) or lengthen "
                "RECOVERY_LEASE_SECONDS: a call must end before a lease whose renewal failed runs out",
                id="recovery.E007",
            )
        )
    bound = spec.in_flight_bound()
    if bound is not None and not spec.is_decision and spec.rerun != Rerun.YES and bound.total_seconds() < timeout:
        errors.append(
            checks.Error(
                f"{where}: its in-flight bound ({bound.total_seconds():g} s) is shorter than its call's timeout "
                f"({timeout:g} s): the receiver may commit a request while the caller is still waiting for it",
                hint="declare settle= at least the timeout plus how long the receiver may go on working on a "
                "request its caller gave up (or settle=None: an operator reconciles)",
                id="recovery.E008",
            )
        )
    return errors


@checks.register(checks.Tags.database)
def check_stranded_runs(app_configs=None, databases=None, **kwargs) -> list[checks.CheckMessage]:
    """``manage.py check --database default``: a warning when unfinished runs need a workflow
    version this code lacks (what ``manage.py check_deploy`` lists). Silent when no database is
    asked for, or it cannot be read (not migrated yet, out of reach)."""
    if not databases or "default" not in databases:
        return []
    try:
        groups = deploys.stranded()
    except DatabaseError:
        return []
    stranded = sum(g.runs for g in groups)
    if not stranded:
        return []
    where = "; ".join(f"{g.workflow} v{g.version}: {g.runs}" for g in groups[:5])
    return [
        checks.Warning(
            f"{stranded} unfinished run(s) need a workflow version this code lacks ({where})",
            hint="keep those versions deployed until their runs drain, or move the runs (manage.py check_deploy)",
            id="recovery.W010",
        )
    ]


def _name(workflow) -> str:
    """How a message names a workflow: its name, and its version when it is not the current one."""
    current = workflow is get_workflow(workflow.name)
    return workflow.name if current else f"{workflow.name} v{workflow.version}"
