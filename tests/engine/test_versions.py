"""Versions side by side (issue 32): a deploy never parks a run. Each run executes, to the end, on
the definition of the version it started on; an executor claims only runs whose version it has;
a run whose version no process has waits in its state, stuck for "version not deployed", and
goes on once its version is deployed again."""

import json
from io import StringIO

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import Client

from recovery import counts, registry, testing
from recovery.api.tokens import issue_token
from recovery.engine.executor import advance
from recovery.engine.loop import run_due
from recovery.engine.publisher import publish_due
from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunState, StepState, WorkflowRun
from recovery.why import why_not_moving
from recovery.workflow import VersionNotDeployed, get_workflow
from tests.support import receivers
from tests.support.engine import assert_invariants
from tests.support.versioned_v1 import versioned_v1

pytestmark = pytest.mark.django_db

EVENT = {"tenant": "t1", "order_id": "dep-1"}


def start(version: int | None = None, **event):
    run, _ = run_start(workflow=get_workflow("test_versioned", version), data={**EVENT, **event})
    return run


def settle(run, clock, rounds: int = 12) -> WorkflowRun:
    """Advance the run as an executor loop would, the clock moved to each wake-up time."""
    return testing.drive(run, clock, max_rounds=rounds, owner="test-executor")


def steps_of(run) -> list[tuple[str, str]]:
    return [(s.step_name, s.state) for s in run.steps.order_by("position")]


def stuck(now) -> dict[str, int]:
    return {c["cause"]: c["count"] for c in counts.stuck_counts(now=now)}


def test_the_registry_holds_versions_side_by_side_and_new_runs_start_on_the_current_one():
    assert registry.versions_of("test_versioned") == [1, 2]
    assert get_workflow("test_versioned").version == 2
    assert [s.name for s in get_workflow("test_versioned", 1).steps] == ["read", "create_task", "post_entry"]
    assert [s.position for s in get_workflow("test_versioned", 1).steps] == [0, 1, 2]
    with pytest.raises(VersionNotDeployed, match="test_versioned v7 is not deployed here .*v1 and v2"):
        get_workflow("test_versioned", 7)
    assert start().workflow_version == 2
    assert start(1, order_id="dep-2").workflow_version == 1


def test_a_workflow_cannot_register_one_version_twice_or_leave_out_a_step_it_lacks():
    with pytest.raises(ValueError, match="workflow .test_versioned. v1 is already registered"):
        get_workflow("test_versioned").derive(version=1)
    with pytest.raises(ValueError, match="has no step nope to leave out"):
        get_workflow("test_versioned").derive(version=3, without=["nope"])
    assert registry.versions_of("test_versioned") == [1, 2]


def test_a_run_executes_to_the_end_on_the_version_it_started_on(clock):
    old, new = start(1), start(order_id="dep-2")
    old, new = settle(old, clock), settle(new, clock)
    assert old.state == new.state == RunState.COMPLETED
    assert steps_of(old) == [("read", "succeeded"), ("create_task", "succeeded"), ("post_entry", "succeeded")]
    assert [name for name, _ in steps_of(new)] == ["read", "check", "create_task", "post_entry"]
    assert [step for step, _ in receivers.CALLS] == ["check"]  # v2's step, for the v2 run only
    assert receivers.counts() == {"task": 2, "message": 0, "ledger": 2, "model_call": 0}
    assert_invariants()


def test_a_run_whose_version_is_not_deployed_waits_in_its_state_and_goes_on_once_it_is(clock, undeploy):
    """The issue's reproduction: a run waits on a rate limit, v1 goes with a deploy. Not a review:
    no executor here claims it; its why-sentence names the version and it counts as stuck. Put v1
    back and it completes, one object per step."""
    receivers.arm("ledger", "rate_limit")
    run = start(1)
    advance(run.pk)
    run.refresh_from_db()
    assert run.state == RunState.WAITING and run.next_wake_at is not None

    undeploy("test_versioned", 1)
    clock.set(run.next_wake_at)
    for _ in range(3):
        assert run_due(owner="v2-only") == 0
        assert publish_due(owner="v2-only") == 0
        clock.advance(60)
    run.refresh_from_db()
    assert run.state == RunState.WAITING and run.lease_owner == ""
    assert not AuditEvent.objects.filter(run=run, action__in=["review", "claim", "lease_takeover"]).exclude(
        at__lt=run.next_wake_at
    )
    why = why_not_moving(run, list(run.steps.all()), now=clock.now())
    assert why == ("started under test_versioned v1; this deployment has v2: deploy v1 again, or move the run")
    assert stuck(clock.now())["version_not_deployed"] == 1
    assert receivers.counts()["ledger"] == 0

    registry._REGISTRY["test_versioned"][1] = versioned_v1  # deployed again
    run = settle(run, clock)
    assert run.state == RunState.COMPLETED and run.workflow_version == 1
    assert receivers.counts() == {"task": 1, "message": 0, "ledger": 1, "model_call": 0}
    assert "check" not in [name for name, _ in steps_of(run)]
    assert stuck(clock.now())["version_not_deployed"] == 0
    assert_invariants()


def test_a_run_of_a_workflow_no_longer_registered_is_not_parked_either(clock, monkeypatch):
    run = start(1)
    monkeypatch.delitem(registry._REGISTRY, "test_versioned")
    assert run_due(owner="elsewhere") == 0
    run.refresh_from_db()
    assert run.state == RunState.PENDING and not run.steps.exclude(state=StepState.PENDING).exists()
    assert why_not_moving(run, list(run.steps.all()), now=clock.now()) == (
        "started under test_versioned v1; this deployment has no test_versioned workflow: deploy it again, "
        "or terminate the run"
    )
    assert stuck(clock.now())["version_not_deployed"] == 1


def test_the_executor_that_lacks_a_version_takes_the_runs_of_the_versions_it_has(clock, undeploy):
    old, new = start(1), start(order_id="dep-2")
    undeploy("test_versioned", 1)
    assert run_due(owner="v2-only") == 1
    old.refresh_from_db()
    new.refresh_from_db()
    assert old.state == RunState.PENDING and new.state == RunState.COMPLETED


# --- starting on a version --------------------------------------------------------------------


def test_start_workflow_starts_a_run_on_a_registered_older_version():
    out = StringIO()
    call_command("start_workflow", "test_versioned", "--version", "1", "--input", json.dumps(EVENT), stdout=out)
    assert WorkflowRun.objects.get(workflow_id=out.getvalue().strip()).workflow_version == 1


def test_start_workflow_refuses_a_version_that_is_not_registered_and_writes_nothing():
    with pytest.raises(CommandError, match="test_versioned v9 is not deployed here"):
        call_command("start_workflow", "test_versioned", "--version", "9", "--input", json.dumps(EVENT))
    assert not WorkflowRun.objects.exists()


def test_the_event_api_starts_a_run_on_the_version_the_request_names():
    token = issue_token(name="canary", workflow_name="test_versioned")[1]
    auth = {"Authorization": f"Bearer {token}"}

    def post(query: str, event: dict):
        url = f"/api/events/test_versioned{query}"
        return Client().post(url, data=json.dumps(event), content_type="application/json", headers=auth)

    response = post("?version=1", EVENT)
    assert response.status_code == 201 and response.json()["version"] == 1
    assert WorkflowRun.objects.get().workflow_version == 1
    for query, message in [("?version=9", "test_versioned v9 is not deployed"), ("?version=x", "a whole number")]:
        refused = post(query, {**EVENT, "order_id": "other"})
        assert refused.status_code == 400 and message in refused.json()["error"]
    assert WorkflowRun.objects.count() == 1


def test_a_run_whose_version_changed_its_steps_without_a_new_number_stops_for_review_before_any_step(
    clock, monkeypatch
):
    """The hazard of a deploy that edits a version in place: the run must not continue on a step
    list its checkpoints were not written for (here v1 gains v2's check without becoming v3)."""
    run = start(1)
    monkeypatch.setitem(registry._REGISTRY, "test_versioned", {2: get_workflow("test_versioned", 2)})
    get_workflow("test_versioned", 2).derive(version=1)  # "v1", now with check: registered in the copy
    advance(run.pk)
    run.refresh_from_db()
    assert run.state == RunState.NEEDS_REVIEW
    assert run.status_reason == (
        "the steps of test_versioned v1 changed under this run without a new version: step 2 is create_task in "
        "its checkpoints and check in the code deployed; declare the change as a new version (keep this one "
        "beside it), or move the run"
    )
    assert not run.steps.exclude(state=StepState.PENDING).exists() and receivers.CALLS == []


def test_the_metrics_count_unfinished_runs_per_version_and_say_which_are_not_deployed(clock, undeploy):
    start(1)
    start(order_id="dep-2")
    settle(start(order_id="dep-3"), clock)  # finished: not counted
    undeploy("test_versioned", 1)
    out = StringIO()
    call_command("metrics", stdout=out)
    lines = [
        line
        for line in out.getvalue().splitlines()
        if line.startswith("recovery_unfinished_runs{") and "test_versioned" in line
    ]
    assert sorted(lines) == [
        'recovery_unfinished_runs{deployed="false",version="1",workflow="test_versioned"} 1.0',
        'recovery_unfinished_runs{deployed="true",version="2",workflow="test_versioned"} 1.0',
    ]
    stuck = [
        line for line in out.getvalue().splitlines() if 'cause="version_not_deployed"' in line and "test_v" in line
    ]
    assert stuck == ['recovery_stuck_runs{cause="version_not_deployed",workflow="test_versioned"} 1.0']


def test_a_celery_task_that_reaches_a_worker_without_the_version_neither_drops_nor_parks_the_run(clock, undeploy):
    """The worker does not claim it; the run stays as it was, due, and the sweeper queues it again
    (for a worker that has the version) once the task it sent is presumed lost."""
    from recovery import tasks
    from recovery.engine import transitions

    run = start(1)
    WorkflowRun.objects.filter(pk=run.pk).update(dispatched_at=clock.now())  # a task was queued for it
    undeploy("test_versioned", 1)
    tasks.advance_run(run.pk)
    run.refresh_from_db()
    assert run.state == RunState.PENDING and run.lease_owner == "" and run.dispatched_at is not None
    assert not AuditEvent.objects.filter(run=run).exclude(action="start").exists()
    assert run.pk not in transitions.runs_dispatch(limit=10)  # its task may still be on its way
    clock.advance(settings.RECOVERY_REDISPATCH_SECONDS + 1)
    assert run.pk in transitions.runs_dispatch(limit=10)
