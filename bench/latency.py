"""Per-step and per-run latency of bench/executor.py's durable contenders, read after each
measurement from the engine's own records in the measurement's database (before it is dropped,
after its transaction counts were read, so these reads are not counted), and the machine the
bench ran on.

Each engine writes a clock reading with every checkpoint: ours the audit event's ``at``
(``recovery_auditevent``, taken as the transition computes its write, just before its commit,
microseconds); DBOS ``operation_outputs.completed_at_epoch_ms`` (taken as it records the step's
output, just before that commit, whole milliseconds), ``workflow_status.created_at`` (the
workflow's status row, the database's ``now()``) and ``workflow_status.updated_at`` (its
completion, the same). From them, the same three figures for both engines, in milliseconds:

step    From the run's previous checkpoint to this step's outcome: the step's durable start
        (the last thing the run recorded before the step began) to its outcome recorded.
        Ours: the claim (or the run's start, which the claim shares when written together), or
        the previous step's outcome, to the step's outcome event (``step_succeed``, or
        ``step_fail``/``step_unknown``); a call step's own ``step_begin`` (its intent) falls inside
        the interval, with its commit. Local steps record intent, attempt and outcome in one
        transaction, and consecutive local steps share it: the three bench steps commit once,
        so the first carries the claim's commit and the call to the database, the next two only
        their own work. DBOS: the workflow's ``created_at`` (first step) or the previous step's
        ``completed_at_epoch_ms``, to this step's ``completed_at_epoch_ms``; DBOS records nothing
        before a step.
intent  From the step's own start as its engine records it to its outcome: ours, a call step's
        ``step_begin`` (intent checkpointed) to its outcome, a local step as ``step`` (it has no
        intent of its own); DBOS, ``started_at_epoch_ms`` (the step wrapper's clock reading as it
        is entered, not a record of its own: written with the outcome) to ``completed_at_epoch_ms``.
run     End to end per run: its start to its completion recorded. Ours: the run's first event
        (``start``) for the contenders that start runs inside the clock, its first ``claim`` for
        pre-started runs (their start was written before the clock), to its last event, the last
        step's outcome, which completes the run in the same checkpoint (there is no separate
        ``complete`` event). DBOS: ``created_at`` to ``updated_at`` of a ``SUCCESS`` workflow.

Percentiles interpolate linearly between the closest ranks (PostgreSQL's ``percentile_cont``);
over repetitions the bench reports the median of each.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import psycopg

PERCENTILES = {"p50": 0.50, "p95": 0.95, "p99": 0.99}
FIGURES = ("step", "intent", "run")
OUTCOMES = frozenset({"step_succeed", "step_fail", "step_unknown"})

OURS_EVENTS = "SELECT run_id, step_name, action, at FROM recovery_auditevent ORDER BY run_id, id"
DBOS_STEPS = (
    "SELECT o.workflow_uuid, w.created_at, w.updated_at, o.started_at_epoch_ms, o.completed_at_epoch_ms "
    "FROM dbos.operation_outputs AS o JOIN dbos.workflow_status AS w USING (workflow_uuid) "
    "WHERE w.status = 'SUCCESS' ORDER BY o.workflow_uuid, o.function_id"
)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 ≤ q ≤ 1), linear between the closest ranks, as ``percentile_cont``."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """count, p50, p95 and p99 of ``values`` (ms, to three decimals)."""
    return {"count": len(values), **{name: round(percentile(values, q), 3) for name, q in PERCENTILES.items()}}


def ours_latencies(events: Iterable[tuple[Any, str, str, Any]], *, prestarted: bool) -> dict[str, list[float]]:
    """Step, intent and run latencies (ms) from audit events ``(run_id, step_name, action, at)``
    in each run's order (by id). ``prestarted``: the run began before the clock, so it counts
    from its claim, not its start."""
    found: dict[str, list[float]] = {figure: [] for figure in FIGURES}
    run = began = checkpoint = last = None
    intents: dict[str, Any] = {}
    for run_id, step_name, action, at in events:
        if run_id != run:
            if run is not None and began is not None:
                found["run"].append(_ms(last - began))
            run, began, checkpoint, last, intents = run_id, None, None, None, {}
        last = at
        if action == "claim" or (action == "start" and not prestarted):
            began = began or at
            checkpoint = at
        elif action == "step_begin":
            intents[step_name] = at
        elif action in OUTCOMES and checkpoint is not None:
            found["step"].append(_ms(at - checkpoint))
            found["intent"].append(_ms(at - intents.pop(step_name, checkpoint)))
            checkpoint = at
    if run is not None and began is not None:
        found["run"].append(_ms(last - began))
    return found


def dbos_latencies(rows: Iterable[tuple[str, int, int, int, int]]) -> dict[str, list[float]]:
    """The same from DBOS's steps ``(workflow, created_at, updated_at, started_at, completed_at)``,
    epoch milliseconds, in each workflow's order (by function id)."""
    found: dict[str, list[float]] = {figure: [] for figure in FIGURES}
    workflow = checkpoint = None
    for workflow_id, created, updated, started, completed in rows:
        if workflow_id != workflow:
            workflow, checkpoint = workflow_id, created
            found["run"].append(float(updated - created))
        found["step"].append(float(completed - checkpoint))
        found["intent"].append(float(completed - started))
        checkpoint = completed
    return found


def measure(url: str, *, engine: str, prestarted: bool = False) -> dict[str, dict[str, float]] | None:
    """The summaries of a measurement's database: ``engine`` is "ours" or "dbos"; None if it
    recorded nothing to measure."""
    with psycopg.connect(url, autocommit=True) as conn:
        if engine == "ours":
            found = ours_latencies(conn.execute(OURS_EVENTS), prestarted=prestarted)
        else:
            found = dbos_latencies(conn.execute(DBOS_STEPS))
    if not all(found.values()):
        return None
    return {figure: summarize(values) for figure, values in found.items()}


def median_of(latencies: Sequence[dict[str, dict[str, float]] | None], figure: str) -> dict[str, float] | None:
    """Each percentile's median over repetitions (and the median count); None unless every one was measured."""
    if not latencies or any(latency is None for latency in latencies):
        return None
    summaries = [latency[figure] for latency in latencies if latency is not None]
    return {key: round(statistics.median(s[key] for s in summaries), 3) for key in summaries[0]}


def table(rows: Sequence[tuple[str, int, Sequence[dict[str, dict[str, float]] | None]]]) -> list[str]:
    """The report's lines: per (contender, workers, its samples' latencies), the medians."""
    measured = [(c, w, medians) for c, w, ls in rows if (medians := {f: median_of(ls, f) for f in FIGURES})["step"]]
    if not measured:
        return []
    width = max(10, *(len(c) + 1 for c, _, _ in measured))
    lines = [
        "step latency, ms (median of the repetitions' percentiles; bench/latency.py defines them): step = the "
        "run's previous checkpoint to the step's outcome; intent = the step's own start to its outcome; "
        "run = start (claim if pre-started) to completion",
        f"{'contender':<{width}}{'workers':>8}{'step p50':>10}{'p95':>8}{'p99':>8}{'intent p50':>12}{'p99':>8}"
        f"{'run p50':>10}{'p95':>8}{'p99':>8}{'steps':>8}",
    ]
    for contender, workers, m in measured:
        step, intent, run = m["step"], m["intent"], m["run"]
        lines.append(
            f"{contender:<{width}}{workers:>8}{step['p50']:>10.2f}{step['p95']:>8.2f}{step['p99']:>8.2f}"
            f"{intent['p50']:>12.2f}{intent['p99']:>8.2f}{run['p50']:>10.2f}{run['p95']:>8.2f}{run['p99']:>8.2f}"
            f"{step['count']:>8.0f}"
        )
    return lines


def machine(postgresql: str, load_start: float, load_end: float) -> dict[str, Any]:
    """What the bench ran on: CPUs and their model, memory, Python, PostgreSQL, load averages."""
    model = memory = None
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
        with open("/proc/meminfo") as meminfo:
            kib = next((int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:")), None)
            memory = round(kib / 2**20, 1) if kib else None
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model or platform.processor() or None,
        "memory_gib": memory,
        "python": platform.python_version(),
        "postgresql": postgresql,
        "load_start": round(load_start, 2),
        "load_end": round(load_end, 2),
    }


def describe(facts: dict[str, Any]) -> str:
    return (
        f"PostgreSQL {facts['postgresql']}, {facts['cpus']} cores ({facts['cpu_model'] or 'model unknown'}), "
        f"{facts['memory_gib']} GiB memory, Python {facts['python']}, load average {facts['load_start']:.1f} "
        f"at the start and {facts['load_end']:.1f} at the end"
    )


def _ms(delta: Any) -> float:
    return delta.total_seconds() * 1000
