"""One commit between two calls (recovery.engine.fold): a call's outcome and the next call's
intent are written together. A crash right after that commit leaves the next step begun and
nothing sent — the state a crash between an intent's commit and its call leaves — and the
takeover reconciles it the same way: by look-up, or by an operator where the step has none."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from recovery.engine import failpoints
from recovery.engine.executor import advance
from recovery.engine.transitions import checkpoints, run_claim, run_start, step_resolve
from recovery.errors import ErrorKind
from recovery.models import AuditEvent, RunState, StepState
from recovery.testing import fault_matrix
from tests.support import receivers
from tests.support.engine import assert_invariants, crash_at, drive

pytestmark = pytest.mark.django_db

EVENT = {"tenant": "t", "order_id": "fold-1", "text": "office chairs 120"}


def events_per_checkpoint(queries) -> list[int]:
    """PostgreSQL: for each checkpoint statement, how many audit events it wrote (one, or its VALUES rows)."""
    return [q["sql"].count("(CAST(%s") or 1 for q in queries.captured_queries if "WITH fenced AS" in q["sql"]]


def actions(run) -> list[tuple[str, str]]:
    return list(AuditEvent.objects.filter(run=run).order_by("id").values_list("action", "step_name"))


def test_a_call_s_outcome_and_the_next_call_s_intent_are_one_write():
    """create_task → notify → post_entry: two writes of two checkpoints each, where each call
    step made two writes of one (intent, outcome); a decision's success still commits alone."""
    run, _ = run_start(workflow="test_orders", data=EVENT)
    lease = run_claim(run_pk=run.pk)
    from recovery.engine.executor import advance_claimed

    with CaptureQueriesContext(connection) as queries:
        assert advance_claimed(lease) == RunState.COMPLETED

    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
    if connection.vendor == "postgresql":
        checkpoints = events_per_checkpoint(queries)
        # read: begin, succeed; decide: begin (its success inserts the decision: a transaction of
        # its own); create_task: begin; its success with notify's intent; notify's with
        # post_entry's; post_entry's, which completes the run.
        assert checkpoints == [1, 1, 1, 1, 2, 2, 1], checkpoints
    written = actions(run)
    folded = [("step_succeed", "create_task"), ("step_begin", "notify")]
    assert written[written.index(folded[0]) : written.index(folded[0]) + 2] == folded
    assert not [a for a in written if a == ("step_begin", "decide")][1:]  # nothing twice
    assert_invariants()


def test_a_crash_right_after_the_folded_commit_reconciles_the_begun_call_by_look_up(clock, monkeypatch):
    """notify was begun in create_task's commit and never sent: the next executor finds it
    running, looks it up (nothing yet), waits out its in-flight window, then sends it once."""
    run, _ = run_start(workflow="test_orders", data=EVENT)
    crash_at(monkeypatch, "create_task:after_outcome", lambda: advance(run.pk))
    notify = run.steps.get(step_name="notify")
    assert notify.state == StepState.RUNNING and notify.attempts == 1 and notify.intent  # begun with it
    assert receivers.counts()["message"] == 0  # nothing sent

    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
    notify = run.steps.get(step_name="notify")
    assert [a for a, name in actions(run) if name == "notify"][:2] == ["step_begin", "step_unknown"]
    assert notify.state == StepState.SUCCEEDED
    assert_invariants()


def test_a_crash_right_after_the_folded_commit_sends_a_step_with_no_look_up_to_an_operator(clock, monkeypatch):
    """tell has no way to find out whether it was sent: begun in open_task's commit, it goes to
    an operator after a crash, as after a crash between its intent and its call — never sent
    again on a guess. The operator's "it did not happen" lets the run go on: one message."""
    run, _ = run_start(workflow="test_folded", data=EVENT)
    crash_at(monkeypatch, "open_task:after_outcome", lambda: advance(run.pk))
    tell = run.steps.get(step_name="tell")
    assert (tell.state, tell.attempts) == (StepState.RUNNING, 1)

    clock.advance(3600)  # the lease long expired: a takeover
    advance(run.pk)

    run.refresh_from_db()
    tell = run.steps.get(step_name="tell")
    assert run.state == RunState.NEEDS_REVIEW and "operator must reconcile" in run.status_reason
    assert (tell.state, tell.last_error_kind) == (StepState.UNKNOWN, ErrorKind.UNKNOWN_OUTCOME)
    assert receivers.counts()["message"] == 0 and receivers.counts()["task"] == 1

    step_resolve(
        workflow_id=run.workflow_id, step_name="tell", actor=None, reason="no message in the outbox", happened=False
    )
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts()["message"] == 1 and receivers.counts()["task"] == 1
    assert_invariants()


def test_a_guard_s_refusal_of_the_next_call_is_written_in_the_commit_of_the_call_before():
    """test_folded's tell is refused for an order on hold: open_task's success and the refusal
    are one write, and nothing is sent."""
    run, _ = run_start(workflow="test_folded", data={**EVENT, "text": "on hold: customer called"})
    lease = run_claim(run_pk=run.pk)
    from recovery.engine.executor import advance_claimed

    with CaptureQueriesContext(connection) as queries:
        assert advance_claimed(lease) == RunState.NEEDS_REVIEW

    run.refresh_from_db()
    assert "policy refused: not_on_hold" in run.status_reason
    assert receivers.counts()["message"] == 0 and receivers.counts()["task"] == 1
    assert actions(run)[-2:] == [("step_succeed", "open_task"), ("policy_refused", "tell")]
    tell = run.steps.get(step_name="tell")
    assert (tell.attempts, tell.refusal["rule"]) == (0, "not_on_hold") and not tell.intent
    if connection.vendor == "postgresql":
        assert events_per_checkpoint(queries) == [1, 2]  # open_task begun; its success with the refusal


test_folded_fault_matrix = fault_matrix(
    "test_folded",
    event=lambda n: {"tenant": "matrix", "order_id": f"f-{n}"},
    effects=lambda run: {"open_task": receivers.counts()["task"], "tell": receivers.counts()["message"]},
)


def test_the_matrix_has_a_crash_right_after_each_folded_commit():
    from recovery.testing import cases
    from recovery.workflow import get_workflow

    ids = {case.id for case in cases(get_workflow("test_folded"))}
    assert "open_task:crash@after_outcome" in ids and failpoints.POINTS[-1] == "after_outcome"


def test_an_agent_s_next_turn_is_added_in_the_commit_of_the_call_that_ends_the_turn_before(clock, monkeypatch):
    """A turn costs two writes of its own, begun and recorded: it is added with the last tool
    call of the turn before (the first turn of an agent that opens its run: on its own)."""
    writes: list[list[tuple[str, str]]] = []
    real_write = checkpoints.write

    def write(lease, written):
        real_write(lease, written)
        writes.append([(c.action, c.step_name) for c in written])

    monkeypatch.setattr(checkpoints, "write", write)
    run = drive(run_start(workflow="test_agent", data={"tenant": "t", "order_id": "fold-agent"})[0], clock)

    assert run.state == RunState.COMPLETED
    assert receivers.counts() == {"task": 0, "message": 1, "ledger": 1, "model_call": 3}
    adds = [write for write in writes if ("agent_turn_add", "resolve") in write]
    assert adds == [
        [("agent_turn_add", "resolve")],
        [("step_succeed", "resolve:1:0:find_invoice"), ("agent_turn_add", "resolve")],
        [("step_succeed", "resolve:2:1:notify_customer"), ("agent_turn_add", "resolve")],
    ]
    for turn in ("resolve:1", "resolve:2", "resolve:3"):
        own = [write for write in writes if any(name == turn for _, name in write)]
        assert own == [[("step_begin", turn)], [("agent_turn", turn)]], own
    assert_invariants()


def test_a_claimed_start_writes_its_first_call_s_intent_with_it():
    """start_and_advance (a Celery worker's start_run): the run, its claim and its first call's
    intent are one write; the call is then made, not taken for one left running by a crash."""
    from recovery.engine.executor import start_and_advance

    with CaptureQueriesContext(connection) as queries:
        run, state = start_and_advance(workflow="test_folded", data=EVENT)

    assert state == RunState.COMPLETED
    assert actions(run)[:3] == [("start", ""), ("claim", ""), ("step_begin", "open_task")]
    assert receivers.counts()["task"] == 1 and receivers.counts()["message"] == 1
    assert not AuditEvent.objects.filter(run=run, action="step_unknown").exists()
    if connection.vendor == "postgresql":
        start = [q["sql"] for q in queries.captured_queries if "WITH new_run AS" in q["sql"]]
        assert len(start) == 1 and start[0].count("(CAST(%s") == 3  # start, claim, step_begin
    assert_invariants()


@pytest.mark.parametrize("point", ["before_call", "after_call"])
def test_a_start_redelivered_after_a_crash_leaves_its_begun_call_to_the_takeover(clock, monkeypatch, point):
    """The worker dies making the first call (before sending it, or after the tracker committed
    it); Celery redelivers start_run: the run exists, this delivery leaves it; the takeover finds
    the call begun and settles it by its declared way (a resend under its key): one task."""
    from recovery.engine.executor import start_and_advance

    crash_at(monkeypatch, f"open_task:{point}", lambda: start_and_advance(workflow="test_folded", data=EVENT))
    run, state = start_and_advance(workflow="test_folded", data=EVENT)  # the redelivery
    assert state is None and run.steps.get(step_name="open_task").state == StepState.RUNNING
    assert receivers.counts()["task"] == (1 if point == "after_call" else 0)

    clock.advance(3600)
    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    assert receivers.counts()["task"] == 1 and receivers.counts()["message"] == 1
    assert [a for a, name in actions(run) if name == "open_task"][:2] == ["step_begin", "step_unknown"]
    assert_invariants()
