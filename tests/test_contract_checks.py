"""SPEC §3: the contract is data; `manage.py check` refuses a workflow with holes in it."""

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from recovery import workflow as registry
from recovery.checks import check_recovery_contracts
from recovery.workflow import Reconcile, Rerun, Workflow, idempotency_key

pytestmark = pytest.mark.django_db(databases=["default", "sandbox"])


@pytest.fixture
def scratch_workflow():
    wf = Workflow("scratch", version=1, workflow_id=lambda i: f"scratch:{i['id']}")
    yield wf
    registry._REGISTRY.pop("scratch", None)


def ids(errors):
    return sorted(e.id for e in errors if "scratch" in e.msg)


def test_non_idempotent_step_without_unknown_outcome_path_fails_check(scratch_workflow):
    @scratch_workflow.step(effect="posts money", rerun=Rerun.NO)
    def pay(ctx):
        return None

    assert ids(check_recovery_contracts()) == ["recovery.E002"]
    with pytest.raises(SystemCheckError, match="no unknown-outcome path"):
        call_command("check")


def test_lookup_without_lookup_function_and_rerun_of_unsafe_step_fail_check(scratch_workflow):
    @scratch_workflow.step(effect="sends", rerun=Rerun.NO, reconcile=Reconcile.LOOKUP)
    def send(ctx):
        return None

    @scratch_workflow.step(effect="posts", rerun=Rerun.NO, reconcile=Reconcile.RERUN)
    def post(ctx):
        return None

    assert ids(check_recovery_contracts()) == ["recovery.E003", "recovery.E004"]


def test_a_complete_contract_passes_and_is_derived_from_the_declaration(scratch_workflow):
    @scratch_workflow.step(effect="creates a ticket", rerun=Rerun.NO, reconcile=Reconcile.OPERATOR, key_version=3)
    def ticket(ctx):
        return None

    assert ids(check_recovery_contracts()) == []
    row = scratch_workflow.contract()[0]
    assert row["step"] == "ticket" and row["safe_to_rerun"] == "no" and row["key_version"] == 3
    assert row["recovery_rule"] == "operator review"


def test_the_project_workflows_pass_the_check():
    call_command("check")


def test_keys_depend_on_workflow_step_and_contract_version_only():
    k = idempotency_key("invoice:t:1", "create_approval_task", 1)
    assert k == idempotency_key("invoice:t:1", "create_approval_task", 1)
    assert (
        len(
            {
                k,
                idempotency_key("invoice:t:1", "create_approval_task", 2),
                idempotency_key("invoice:t:2", "create_approval_task", 1),
                idempotency_key("invoice:t:1", "notify_approver", 1),
            }
        )
        == 4
    )
