"""the contract table: the contract is data; `manage.py check` refuses a workflow with holes in it."""

from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from recovery import registry
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


def test_a_call_that_cannot_end_inside_the_lease_fails_check_with_the_numbers(scratch_workflow, settings):
    """contract rule 12: no call stays in flight past the lease of the executor that made it."""
    settings.RECOVERY_LEASE_SECONDS, settings.RECOVERY_HEARTBEAT_SECONDS = 30, 10

    @scratch_workflow.step(effect="creates a ticket", rerun=Rerun.NO, reconcile=Reconcile.OPERATOR, timeout=25)
    def ticket(ctx):
        return None

    errors = [e for e in check_recovery_contracts() if "scratch" in e.msg]
    assert [e.id for e in errors] == ["recovery.E007"]
    assert "25 + 10 = 35 s does not fit the lease of 30 s" in errors[0].msg
    with pytest.raises(SystemCheckError, match="does not fit the lease"):
        call_command("check")


def test_the_model_providers_timeout_is_checked_against_the_lease(settings):
    """The invoice workflow's model call: OPENAI_TIMEOUT with the openai provider, nothing offline."""
    settings.MODEL_PROVIDER, settings.OPENAI_TIMEOUT = "openai", 30
    settings.RECOVERY_LEASE_SECONDS, settings.RECOVERY_HEARTBEAT_SECONDS = 30, 10
    errors = [e for e in check_recovery_contracts() if e.msg.startswith("invoice.classify")]
    assert [e.id for e in errors] == ["recovery.E007"] and "30 + 10 = 40 s" in errors[0].msg
    settings.OPENAI_TIMEOUT = 20
    assert [e for e in check_recovery_contracts() if e.msg.startswith("invoice.")] == []
    settings.MODEL_PROVIDER = "rules"
    settings.RECOVERY_LEASE_SECONDS, settings.RECOVERY_HEARTBEAT_SECONDS = 3, 1
    assert [e for e in check_recovery_contracts() if e.msg.startswith("invoice.classify")] == []


def test_an_in_flight_bound_shorter_than_the_calls_timeout_fails_check(scratch_workflow, settings):
    """contract rule 7: a miss proves absence only once the request can no longer commit; a bound
    shorter than the caller's own wait cannot say that."""
    settings.RECOVERY_LEASE_SECONDS, settings.RECOVERY_HEARTBEAT_SECONDS = 30, 10

    @scratch_workflow.step(
        effect="sends", rerun=Rerun.NO, reconcile=Reconcile.OPERATOR, settle=timedelta(seconds=2), timeout=5
    )
    def send(ctx):
        return None

    errors = [e for e in check_recovery_contracts() if "scratch" in e.msg]
    assert [e.id for e in errors] == ["recovery.E008"]
    assert "in-flight bound (2 s) is shorter than its call's timeout (5 s)" in errors[0].msg


def test_the_in_flight_bound_defaults_to_the_timeout_plus_the_settle_margin_and_shows_in_the_contract(
    scratch_workflow, settings
):
    settings.RECOVERY_HTTP_TIMEOUT, settings.RECOVERY_SETTLE_SECONDS = 5, 60

    @scratch_workflow.step(effect="a", rerun=Rerun.NO, reconcile=Reconcile.OPERATOR)
    def default(ctx):
        return None

    @scratch_workflow.step(effect="b", rerun=Rerun.NO, reconcile=Reconcile.OPERATOR, settle=timedelta(minutes=10))
    def declared(ctx):
        return None

    @scratch_workflow.step(effect="c", rerun=Rerun.NO, reconcile=Reconcile.OPERATOR, settle=None)
    def unbounded(ctx):
        return None

    assert default.in_flight_bound() == timedelta(seconds=65)
    assert declared.in_flight_bound() == timedelta(minutes=10)
    assert unbounded.in_flight_bound() is None
    rows = {row["step"]: row["in_flight_bound"] for row in scratch_workflow.contract()}
    assert rows == {
        "default": "65 s (default: timeout + RECOVERY_SETTLE_SECONDS)",
        "declared": "600 s",
        "unbounded": "unbounded: a miss goes to an operator",
    }
