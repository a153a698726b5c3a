"""Replay before deploy: prove that the code under test can continue recorded runs.

A recorded run is its checkpoints as ``manage.py show_run --json`` prints them (its steps with
their positions, key versions, keys and states, and its accepted decisions). ``replay`` judges
each against the workflow definitions registered in this process — the code about to be
deployed, in a test of the project — without a database: the run's version must be registered,
its step list must be the one its checkpoints were written for, every key must be the one the
code derives, every step begun must keep its key version, and every accepted decision must still
validate against today's schema. A run whose version the code no longer has is judged by whether
a move to the current version could continue it (``transitions.move_plan``).

    from recovery.testing import assert_replayable, load_recorded
    def test_the_code_continues_recorded_runs():
        assert_replayable(load_recorded("tests/fixtures/recorded"))
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from recovery import registry
from recovery.engine import transitions
from recovery.models import DecisionState, ModelDecision, StepExecution, WorkflowRun


@dataclass
class Replayed:
    """What replaying one recorded run found: ``problems`` empty when the code continues it."""

    workflow_id: str
    workflow: str
    version: int
    problems: list[str] = field(default_factory=list)
    moved: str = ""  # its version is not in the code: what a move to the current one would do

    @property
    def ok(self) -> bool:
        return not self.problems


def load_recorded(path: str | Path) -> list[dict[str, Any]]:
    """The recorded runs in ``path``: a ``show_run --json`` file, or a folder of them (``*.json``),
    or a JSON Lines file of such documents."""
    path = Path(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    documents = []
    for file in files:
        text = file.read_text(encoding="utf-8")
        if file.suffix == ".jsonl":
            documents += [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            documents.append(json.loads(text))
    return documents


def replay(documents: Iterable[dict[str, Any]], *, allow_moves: bool = False) -> list[Replayed]:
    """Judge each recorded run against the code registered here. With ``allow_moves``, a run whose
    version the code no longer has passes when a move to the current version could continue it."""
    return [_replay_one(document, allow_moves) for document in documents]


def assert_replayable(documents: Iterable[dict[str, Any]], *, allow_moves: bool = False) -> list[Replayed]:
    """``replay``, raising AssertionError that lists every run the code could not continue, and why."""
    found = replay(documents, allow_moves=allow_moves)
    failing = [r for r in found if not r.ok]
    if failing:
        lines = [f"{r.workflow_id} ({r.workflow} v{r.version}): {'; '.join(r.problems)}" for r in failing]
        raise AssertionError(f"{len(failing)} of {len(found)} recorded runs cannot continue:\n" + "\n".join(lines))
    return found


def _replay_one(document: dict[str, Any], allow_moves: bool) -> Replayed:
    try:
        run, rows, decisions = _checkpoints(document)
    except (KeyError, TypeError, ValueError) as exc:
        wid = document.get("workflow_id", "?") if isinstance(document, dict) else "?"
        return Replayed(str(wid), "?", 0, [f"not a recorded run (show_run --json): {type(exc).__name__}: {exc}"])
    found = Replayed(run.workflow_id, run.workflow_name, run.workflow_version)
    try:
        definition = registry.workflow_of(run)
    except LookupError as exc:
        current = registry.current_version(run.workflow_name)
        if current is None:
            found.problems.append(str(exc))
            return found
        plan = transitions.move_plan(run, rows, registry.get_workflow(run.workflow_name, current), decisions)
        found.moved = plan.summary()
        if not (allow_moves and plan.ok):
            found.problems.append(f"{exc}; {plan.summary()}")
        return found
    found.problems = transitions.continuation(run, rows, definition, decisions)
    return found


def _checkpoints(document: dict[str, Any]) -> tuple[WorkflowRun, list[StepExecution], dict[str, ModelDecision]]:
    """The run, its steps and its accepted decisions as unsaved rows, from a recorded document."""
    run = WorkflowRun(
        workflow_id=document["workflow_id"],
        workflow_name=document["workflow"],
        workflow_version=int(document["workflow_version"]),
        state=document["state"],
    )
    rows = []
    for index, step in enumerate(document["steps"]):
        rows.append(
            StepExecution(
                pk=index + 1,  # the order rows were written in, as recorded (journal rows share a position)
                step_name=step["name"],
                position=int(step["position"]),
                state=step["state"],
                key_version=int(step["key_version"]),
                restarts=int(step.get("restarts") or 0),
                idempotency_key=step["idempotency_key"],
                attempts=int(step.get("attempts") or 0),
                remote_ref=step.get("remote_ref") or "",
                refusal=step.get("refusal"),
                next_attempt_at=_when(step.get("next_attempt_at")),
            )
        )
    decisions = {
        name: ModelDecision(
            step_name=name,
            version=int(d["version"]),
            schema_version=int(d["schema_version"]),
            accepted=d["accepted"],
            state=DecisionState.ACCEPTED,
        )
        for name, d in (document.get("decisions") or {}).items()
    }
    return run, rows, decisions


def _when(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None
