"""Replay before deploy (issue 32): recorded runs (``show_run --json``) are judged against the
code under test — here the project's own — without a database: the demo's recorded runs continue
on it, and each way a deploy can break a run (a version gone, a step list edited in place, a key
derived differently, a decision that no longer fits its schema) is named."""

import copy
import json
from pathlib import Path

import pytest

from recovery import clock, registry
from recovery.console.selectors import run_document
from recovery.engine.transitions import run_start
from recovery.testing import assert_replayable, load_recorded, replay
from recovery.workflow import get_workflow
from tests.support.engine import drive

RECORDED = Path(__file__).parent / "fixtures" / "recorded_runs"  # the demo's runs, as show_run --json gave them


def test_the_code_continues_every_recorded_demo_run():
    found = assert_replayable(load_recorded(RECORDED))
    assert len(found) == 16
    assert {(r.workflow, r.version) for r in found} == {("invoice", 1), ("dispute", 1)}


def recorded(run) -> dict:
    return json.loads(json.dumps(run_document(run.workflow_id, now=clock.now())))


@pytest.mark.django_db(transaction=True)
def test_each_way_a_deploy_breaks_a_recorded_run_is_named(clock, monkeypatch, undeploy):
    v1 = recorded(run_start(workflow=get_workflow("test_versioned", 1), data={"tenant": "t", "order_id": "r1"})[0])
    orders = recorded(drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "r2"})[0], clock))
    assert all(r.ok for r in replay([v1, orders]))

    rekeyed = copy.deepcopy(v1)
    rekeyed["steps"][1]["idempotency_key"] = "0" * 64
    unfit = copy.deepcopy(orders)
    unfit["decisions"]["decide"]["accepted"]["category"] = "catering"
    found = replay([rekeyed, unfit, {"workflow_id": "x:1"}])
    assert found[0].problems == ["create_task: its key is not the one this code derives for its key version"]
    assert found[1].problems == [
        "decide's accepted decision does not fit v1's Decision (category: String should match pattern "
        "'^(office|travel)$')"
    ]
    assert found[2].problems == ["not a recorded run (show_run --json): KeyError: 'workflow'"]

    # v1 edited in place: it gained v2's check without a new number
    monkeypatch.setitem(registry._REGISTRY, "test_versioned", {2: get_workflow("test_versioned", 2)})
    get_workflow("test_versioned", 2).derive(version=1)
    assert replay([v1])[0].problems == [
        "the steps of test_versioned v1 changed under this run without a new version: step 2 is create_task in "
        "its checkpoints and check in the code deployed; declare the change as a new version (keep this one "
        "beside it), or move the run"
    ]

    # v1 gone: not continued as it is, but a move to v2 would
    undeploy("test_versioned", 1)
    gone = replay([v1])[0]
    assert gone.problems == [
        "test_versioned v1 is not deployed here (this deployment has v2); can move to v2 (adds check)"
    ]
    assert replay([v1], allow_moves=True)[0].ok
    with pytest.raises(AssertionError, match=r"1 of 1 recorded runs cannot continue:\nversioned:t:r1 "):
        assert_replayable([v1])


def test_without_invoice_v1_the_recorded_runs_say_which_a_move_to_the_current_version_would_continue(undeploy):
    undeploy("invoice", 1)
    recorded_runs = load_recorded(RECORDED)
    with pytest.raises(AssertionError, match="13 of 16 recorded runs cannot continue"):
        assert_replayable(recorded_runs)
    found = {r.workflow_id: r for r in replay(recorded_runs, allow_moves=True)}
    movable = sorted(wid for wid, r in found.items() if wid.startswith("invoice:") and r.ok)
    assert movable == ["invoice:globex:GX-2024-119", "invoice:initech:IN-5532"]  # stopped before the task
    moved = "can move to v3 (adds check_duplicate, watch_approval_task, approver_decision)"
    assert found["invoice:globex:GX-2024-119"].moved == moved
    assert found["invoice:wayne:WE-3302"].problems == [
        "invoice v1 is not deployed here (this deployment has v2 and v3); cannot move to v3: create_approval_task "
        "is step 3 of this run and step 4 of v3: the steps before it differ"
    ]
