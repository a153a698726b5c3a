"""System checks: ``manage.py check`` fails for a workflow whose recovery contract has holes."""

from django.core import checks

from .workflow import Reconcile, Rerun, all_workflows


@checks.register()
def check_recovery_contracts(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    for workflow in all_workflows():
        if not workflow.steps:
            errors.append(checks.Error(f"workflow {workflow.name!r} declares no steps", id="recovery.E001"))
        for spec in workflow.steps:
            where = f"{workflow.name}.{spec.name}"
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
    return errors
