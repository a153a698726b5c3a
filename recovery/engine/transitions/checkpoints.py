"""The executor's writes: a transition decided on a draft of the leased run is a ``Checkpoint``
value, and ``Lease.commit`` is the one code that writes checkpoints.

An executor transition reads nothing it has not got and writes nothing itself: it is a function
from the leased run as the executor last wrote it (a ``Draft``: copies of the run and of the
steps it changes) and its inputs to a ``Checkpoint`` — the run's and the steps' changed fields,
the rows to insert, the audit event. ``Lease.commit`` writes one checkpoint or a list of them
(a group of local steps, a step's outcome with the next step's intent) fenced by the lease's
generation and the run's revision as the draft read it: on PostgreSQL as one statement (new step
rows included, unless it inserts a ModelDecision: then one transaction), elsewhere as one
transaction. Only once that write has succeeded does the executor's copy (``Lease.seen``)
become the draft's. A fence that no longer matches (someone else saved the run, or the lease is
gone) writes nothing and raises ``FenceMiss``; the caller reads the run again and decides again
(``transitions._core.transition`` does it under the run's lock): a transition's decision may be
made twice, its write never.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connection, models, transaction
from django.db.models.base import ModelState

from recovery.engine import observed, storage
from recovery.errors import LeaseLost
from recovery.models import AuditEvent, StepExecution, WorkflowPause, WorkflowRun

from .tables import EXECUTOR, LEASED_RUN_STATES, PAUSE_POINTS


class FenceMiss(Exception):
    """A checkpoint's fence matched nothing: someone else saved the run since the draft was
    read, or the lease is gone. Nothing of it was written; the executor's copy is dropped."""


@dataclass(frozen=True)
class Lease:
    """An executor's claim on a run: the fencing token every executor transition checks.

    ``seen`` is the executor's copy of the run and its steps as its own checkpoints last left
    them (``leased_run``); it changes only when a checkpoint has been written, and is dropped as
    soon as a write finds that someone else has saved the run since (``WorkflowRun.revision``)."""

    run_pk: int
    owner: str
    generation: int
    seen: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # The claim took the run over from an executor whose lease expired (it died, or hung):
    # whatever it was doing may have killed it, so this executor checkpoints every attempt
    # before making it, local steps included (see executor._execute, local_steps).
    taken_over: bool = False
    # The step whose intent the claim's own write checkpointed (a claimed start's first call:
    # ``run_start_claimed``), to be called next — not a step left running by a lost executor.
    begun: str = ""

    def commit(self, checkpoints: Checkpoint | Sequence[Checkpoint]) -> None:
        """Write ``checkpoints`` (all decided on one draft of this lease's run) as one write;
        then the copy is the draft. Raises FenceMiss, writing nothing, if the run changed
        since the draft was read or the lease is gone."""
        write(self, [checkpoints] if isinstance(checkpoints, Checkpoint) else list(checkpoints))

    @contextmanager
    def atomic(self) -> Iterator[None]:
        """A transaction around checkpoints and other writes of the caller's (a local step's
        effect, an outbox message): if it rolls back, the copy is again what it was before it —
        which is what the database holds again. A fence miss leaves no copy."""
        saved = dict(self.seen)
        try:
            with transaction.atomic():
                yield
        except FenceMiss:
            self.seen.clear()
            raise
        except BaseException:
            self.seen.clear()
            self.seen.update(saved)
            raise


def _clone(obj: models.Model) -> models.Model:
    """A copy of a model instance to decide on: its own field values and state, no cached
    relation (the caller points a step's ``run`` at the draft's run)."""
    new = obj.__class__.__new__(obj.__class__)
    new.__dict__.update(obj.__dict__)
    state = ModelState()
    state.db, state.adding = obj._state.db, obj._state.adding
    new._state = state
    return new


def _point(step: StepExecution, run: WorkflowRun) -> None:
    """``step.run = run``, without the descriptor's checks (the same model, the same database)."""
    step.run_id = run.pk
    StepExecution.run.field.set_cached_value(step, run)


class Draft:
    """The leased run as a transition decides on it: a copy of the run and, once asked for
    (``step``), of each step it changes, over the executor's copy (or fresh rows, locked when
    ``Draft.read(lease, locked=True)``). ``revision`` is the run's revision as read: the fence."""

    def __init__(self, lease: Lease, run: WorkflowRun, steps: dict[str, StepExecution], *, locked: bool = False):
        self.lease = lease
        self.revision = run.revision
        self.run: WorkflowRun = _clone(run)
        self._read = steps
        self.changed: dict[str, StepExecution] = {}
        self.checkpoints: list[Checkpoint] = []
        self.locked = locked
        self._paused: list[WorkflowPause] | None = None

    @classmethod
    def read(cls, lease: Lease, *, locked: bool = False) -> Draft:
        """A draft of the lease's run: over its copy, or read again (under the run's row lock
        when ``locked``, inside the caller's transaction). Raises LeaseLost if the lease is gone."""
        if locked:
            run = _locked_run(lease)
            lease.seen.update(_copy(run, StepExecution.objects.filter(run_id=run.pk).order_by("position", "pk")))
        elif leased_run(lease) is None:
            lease.seen.clear()
            raise LeaseLost(f"lease {lease.generation} on run {lease.run_pk} is no longer held")
        return cls(lease, lease.seen["run"], lease.seen["steps"], locked=locked)

    def workflow_pause(self, step_name: str) -> WorkflowPause | None:
        """The supervisor's pause in force of the run's workflow, or of ``step_name``, that stops
        a new attempt of that step (the whole workflow's first). Read only on a draft read under
        the run's lock; on the executor's copy, None: its write checks it (``write``)."""
        if not self.locked:
            return None
        if self._paused is None:
            paused = WorkflowPause.objects.filter(workflow_name=self.run.workflow_name, released_at__isnull=True)
            self._paused = list(paused.order_by("step_name"))
        exempt = self.run.workflow_pause_id  # a canary, released from that pause in force
        return next((p for p in self._paused if p.step_name in ("", step_name) and p.pk != exempt), None)

    def step(self, name: str) -> StepExecution:
        """The step to change, as this draft has it (a copy of it, made at the first ask)."""
        step = self.changed.get(name)
        if step is None:
            step = _clone(self._read[name])
            _point(step, self.run)
            self.changed[name] = step
        return step

    def steps(self) -> list[StepExecution]:
        """Every step of the run as this draft has it, in order."""
        merged = {**self._read, **self.changed}
        return sorted(merged.values(), key=lambda s: s.order)

    def add(self, row: StepExecution) -> None:
        """A new step row (an agent's journal row), inserted by the checkpoint that adds it."""
        _point(row, self.run)
        self.changed[row.step_name] = row

    def copy(self) -> dict[str, Any]:
        return {"run": self.run, "steps": {**self._read, **self.changed}}


@dataclass
class Checkpoint:
    """What one executor transition writes, as a value: the run's changed fields and each
    changed step's (by name), rows to insert (in order), and its audit event. Decided on
    ``draft``; fenced by the draft's revision and its lease's generation."""

    draft: Draft
    action: str
    step_name: str
    run: dict[str, Any]
    steps: dict[str, dict[str, Any]]
    rows: list[models.Model]
    event: dict[str, Any]
    after: dict[str, Any]

    @property
    def fence(self) -> dict[str, Any]:
        return {
            "lease_generation": self.draft.lease.generation,
            "revision": self.draft.revision,
            "state": LEASED_RUN_STATES,
        }


def write(lease: Lease, checkpoints: list[Checkpoint]) -> None:
    draft = checkpoints[0].draft
    assert checkpoints and all(c.draft is draft for c in checkpoints), "one write is of one draft"
    assert draft.lease is lease
    run_values: dict[str, Any] = {}
    step_values: dict[str, dict[str, Any]] = {}
    rows: list[models.Model] = []
    for checkpoint in checkpoints:
        run_values.update(checkpoint.run)
        for name, values in checkpoint.steps.items():
            step_values.setdefault(name, {}).update(values)
        rows.extend(checkpoint.rows)
    inserted = {row.step_name for row in rows if isinstance(row, StepExecution)}
    updates = {draft.changed[name].pk: values for name, values in step_values.items() if name not in inserted}
    events = [checkpoint.event for checkpoint in checkpoints]
    fence = checkpoints[0].fence
    # A new attempt is written only while no pause of its workflow or step is in force; under
    # the run's lock, the draft read them (``Draft.workflow_pause``) just before.
    begun = sorted({c.step_name for c in checkpoints if c.action in PAUSE_POINTS})
    if begun and not draft.locked:
        fence["unpaused"] = storage.Unpaused(draft.run.workflow_name, tuple(begun))
    # One statement writes new step rows (an agent's journal) too; a ModelDecision row is
    # written with its checkpoint in one transaction, through the ORM (it is rare: a decision's
    # success, which commits alone).
    if connection.vendor == "postgresql" and all(isinstance(row, StepExecution) for row in rows):
        written = _one_statement(lease.run_pk, run_values, fence, updates, events, draft, rows)
    else:
        written = _one_transaction(lease.run_pk, run_values, fence, updates, rows, events)
    if not written:
        lease.seen.clear()
        raise FenceMiss(f"run {lease.run_pk} was saved by someone else, or lease {lease.generation} is gone")
    lease.seen.clear()
    lease.seen.update(draft.copy())
    for checkpoint in checkpoints:
        _observed(draft.run, checkpoint.action, checkpoint.step_name, checkpoint.after, EXECUTOR)


def _one_statement(
    run_pk: int,
    run_values: dict[str, Any],
    fence: dict[str, Any],
    updates: dict[int, dict[str, Any]],
    events: list[dict[str, Any]],
    draft: Draft,
    rows: list[StepExecution],
) -> bool:
    if len(updates) == 1 and len(events) == 1 and not rows:
        (step_pk, values), event = next(iter(updates.items())), events[0]
        return storage.checkpoint(run_pk, run_values, fence, step_pk, values, event)
    # One statement writes the same columns of each step: each step's changed ones, with the
    # draft's values of the others (what the database holds while the fence matches).
    columns = set().union(*updates.values()) if updates else set()
    by_pk = {step.pk: step for step in draft.changed.values()}
    steps = {
        pk: {name: values.get(name, getattr(by_pk[pk], name)) for name in columns} for pk, values in updates.items()
    }
    if not rows:
        return storage.checkpoint_many(run_pk, run_values, fence, steps, events)
    ids = storage.checkpoint_adding(run_pk, run_values, fence, steps, events, rows)
    if ids is None:
        return False
    for row in rows:  # as row.save() leaves it
        row.pk = ids[row.step_name]
        row._state.adding, row._state.db = False, DEFAULT_DB_ALIAS
    return True


def _one_transaction(
    run_pk: int,
    run_values: dict[str, Any],
    fence: dict[str, Any],
    updates: dict[int, dict[str, Any]],
    rows: Iterable[models.Model],
    events: list[dict[str, Any]],
) -> bool:
    """The fenced UPDATE of the run first (it takes the run's row lock, which every writer of
    the run or its steps takes first), then the steps, the new rows and the audit events."""
    with transaction.atomic():
        if storage.update(WorkflowRun, run_pk, run_values, **fence) != 1:
            return False
        for pk, values in updates.items():
            storage.update(StepExecution, pk, values)
        for row in rows:
            row.skip_history_when_saving = True  # the executor's own write (see _core._history_user)
            row.save(force_insert=True)
        for event in events:
            storage.insert(AuditEvent, event)
    return True


def _observed(run: WorkflowRun, action: str, step_name: str, after: dict, actor: str) -> None:
    """Counted and logged once the transition's transaction commits (recovery.engine.observed)."""
    observed.transition(
        workflow_id=run.workflow_id,
        workflow=run.workflow_name,
        action=action,
        step=step_name,
        after=after,
        lease_generation=run.lease_generation,
        actor=actor,
    )


def _locked_run(lease: Lease) -> WorkflowRun:
    """Lock the run and check the fencing token. Raises LeaseLost if another executor took it.

    The run's row lock is what every writer of the run or of its steps takes first; if the
    run's revision is the one this executor last wrote, nobody else has changed either since,
    and ``lease.seen`` stays; otherwise it is dropped."""
    run = WorkflowRun.objects.select_for_update().filter(pk=lease.run_pk).first()
    if run is None or run.lease_generation != lease.generation or run.state not in LEASED_RUN_STATES:
        lease.seen.clear()
        raise LeaseLost(f"lease {lease.generation} on run {lease.run_pk} is no longer held")
    seen = lease.seen.get("run")
    if seen is None or seen.revision != run.revision:
        lease.seen.clear()
    lease.seen["run"] = run  # saved by the transition, it is again what this executor last wrote
    return run


def leased_run(lease: Lease) -> tuple[WorkflowRun, list[StepExecution]] | None:
    """The run and its steps (in order) as the lease holder sees them: its own copy while it is
    current, else read again (one statement, one snapshot). None if the lease is lost."""
    run, steps = lease.seen.get("run"), lease.seen.get("steps")
    if run is None or steps is None:
        rows = list(StepExecution.objects.filter(run_id=lease.run_pk).select_related("run").order_by("position", "pk"))
        if not rows:
            run = WorkflowRun.objects.filter(pk=lease.run_pk).first()
            if run is None:
                return None
        else:
            run = rows[0].run
        lease.seen.update(_copy(run, rows))
        steps = lease.seen["steps"]
    if run.lease_generation != lease.generation or run.state not in LEASED_RUN_STATES:
        return None
    return run, sorted(steps.values(), key=lambda s: s.order)


def _copy(run: WorkflowRun, steps: Iterable[StepExecution]) -> dict[str, Any]:
    """``Lease.seen`` for a run and its steps, each step pointing at that run."""
    by_name = {}
    for step in steps:
        _point(step, run)
        by_name[step.step_name] = step
    return {"run": run, "steps": by_name}
