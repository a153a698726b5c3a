"""Local steps (``local=True``): the effect is a write to the engine's own database, made in the
transaction that records the step's outcome. Under every fault of the matrix each step's row
exists exactly once at the end, and a failed or interrupted attempt leaves none."""

import pytest

from recovery import failpoints
from recovery.executor import advance
from recovery.models import RunState, StepState
from recovery.testing import fault_matrix
from recovery.transitions import run_start
from tests.conftest import drive
from tests.support.models import RemoteObject

pytestmark = pytest.mark.django_db(transaction=True)


def local_effects(run) -> dict[str, int]:
    keys = dict(run.steps.values_list("step_name", "idempotency_key"))
    return {name: RemoteObject.objects.filter(kind="local", client_ref=key).count() for name, key in keys.items()}


test_local_fault_matrix = fault_matrix(
    "test_local", event=lambda n: {"tenant": "matrix", "order_id": f"l-{n}"}, effects=local_effects
)


def test_a_crash_after_the_call_rolls_the_effect_back_and_the_next_executor_makes_it_once(clock, monkeypatch):
    run = run_start(workflow="test_local", data={"tenant": "t", "order_id": "1"})[0]
    monkeypatch.setenv("RECOVERY_FAILPOINTS", "reserve:after_call=raise")
    with pytest.raises(failpoints.FailpointRaised):
        advance(run.pk)
    monkeypatch.delenv("RECOVERY_FAILPOINTS")
    assert RemoteObject.objects.filter(kind="local").count() == 0  # the call ran; its transaction did not commit
    assert run.steps.get(step_name="reserve").state == StepState.RUNNING

    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    assert local_effects(run) == {"reserve": 1, "book": 1}
    reserve = run.steps.get(step_name="reserve")
    assert reserve.attempts == 2 and reserve.remote_ref.startswith("local-")


def test_a_local_step_cannot_also_declare_another_way_to_reconcile(monkeypatch):
    from recovery import workflow
    from recovery.workflow import Reconcile, Workflow

    monkeypatch.setattr(workflow, "_REGISTRY", dict(workflow._REGISTRY))  # keep the registry as it was
    wf = Workflow("local_bad", version=1, workflow_id=lambda i: "x")
    with pytest.raises(ValueError, match="local step"):
        wf.step(local=True, reconcile=Reconcile.LOOKUP)(lambda ctx: None)
    with pytest.raises(ValueError, match="local step"):
        wf.step(local=True, outbox=True)(lambda ctx: None)
