"""The engine test workflow's fault matrix: the same proof, generated for another workflow,
shows that recovery.testing knows nothing about invoices."""

from recovery.testing import fault_matrix
from recovery.workflow import compensation_key
from tests.support.models import RemoteObject


def order_effects(run) -> dict[str, int]:
    keys = dict(run.steps.values_list("step_name", "idempotency_key"))
    return {
        "create_task": RemoteObject.objects.filter(kind="task", dedupe_key=keys["create_task"]).count(),
        "notify": RemoteObject.objects.filter(kind="message", client_ref=keys["notify"]).count(),
        "post_entry": RemoteObject.objects.filter(kind="ledger", dedupe_key=run.workflow_id).count(),
    }


def order_compensations(run) -> dict[str, int]:
    """What each step's compensation made, counted at the receivers (each under its own key)."""
    key = {name: compensation_key(run.workflow_id, name, 1) for name in ("create_task", "notify", "post_entry")}
    return {
        "create_task": RemoteObject.objects.filter(kind="task_cancel", dedupe_key=key["create_task"]).count(),
        "notify": RemoteObject.objects.filter(kind="correction", client_ref=key["notify"]).count(),
        "post_entry": RemoteObject.objects.filter(kind="reversal", dedupe_key=key["post_entry"]).count(),
    }


test_orders_fault_matrix = fault_matrix(
    "test_orders",
    event=lambda n: {"tenant": "matrix", "order_id": f"o-{n}"},
    effects=order_effects,
    compensations=order_compensations,
)
