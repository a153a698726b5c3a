"""The Prometheus exposition: the engine's counters and histograms — every process's, through
``PROMETHEUS_MULTIPROC_DIR``, else this process's own — and gauges read from the database."""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.samples import Sample

from recovery import clock, counts
from recovery.models import WorkflowPause
from recovery.registry import has as deployed_here
from recovery.workflow import all_workflows

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class DatabaseGauges:
    """``recovery_runs``, ``recovery_stuck_runs`` (each series capped at counts.COUNT_CAP: a
    value of 10000 means at least that many), ``recovery_unfinished_runs`` per version,
    ``recovery_outbox_oldest_undelivered_seconds``, ``recovery_paused_since_seconds`` and
    ``recovery_waiting_steps``, read at scrape time in six statements."""

    def collect(self) -> Iterator[Metric]:
        now = clock.now()
        found = counts.by_workflow(counts.workflow_names([wf.name for wf in all_workflows()]), now=now)
        cap = f"(capped at {counts.COUNT_CAP:,}: that value means at least as many)"
        runs = GaugeMetricFamily("recovery_runs", f"Runs by workflow and state {cap}.", labels=["workflow", "state"])
        for (workflow, state), (n, _) in found["states"].items():
            runs.add_metric([workflow, state], n)
        yield runs
        stuck = GaugeMetricFamily(
            "recovery_stuck_runs",
            f"Runs waiting for a person or in trouble, by workflow and cause {cap}.",
            labels=["workflow", "cause"],
        )
        for (workflow, cause), (n, _) in found["stuck"].items():
            stuck.add_metric([workflow, cause], n)
        yield stuck
        unfinished = GaugeMetricFamily(
            "recovery_unfinished_runs",
            "Runs not finished by workflow and version, and whether this deployment has that version: a "
            "version may be removed from the code once its count is 0.",
            labels=["workflow", "version", "deployed"],
        )
        for row in counts.unfinished_by_version():
            deployed = "true" if deployed_here(row["workflow"], row["version"]) else "false"
            unfinished.add_metric([row["workflow"], str(row["version"]), deployed], row["runs"])
        yield unfinished
        paused = GaugeMetricFamily(
            "recovery_paused_since_seconds",
            'Pauses in force of a workflow (step "") or of one of its steps, by who paused it ("automatic": the '
            'step paused itself, pause_after; else "supervisor"): how long each has been in force.',
            labels=["workflow", "step", "by"],
        )
        for pause in WorkflowPause.objects.filter(released_at__isnull=True):
            by = "automatic" if pause.automatic else "supervisor"
            paused.add_metric([pause.workflow_name, pause.step_name, by], (now - pause.paused_at).total_seconds())
        yield paused
        waiting = GaugeMetricFamily(
            "recovery_waiting_steps",
            "Waits under way, holding no worker, by workflow, step and cause: a wait step (wait: an event, a "
            "time), or a tool call held for a person's decision (approval; step: the tool).",
            labels=["workflow", "step", "cause"],
        )
        for (workflow, step, cause), n in counts.waiting_steps().items():
            waiting.add_metric([workflow, step, cause], n)
        yield waiting
        yield GaugeMetricFamily(
            "recovery_outbox_oldest_undelivered_seconds",
            "Age of the oldest outbox message not yet delivered (0 when none is waiting).",
            value=counts.oldest_undelivered(now),
        )


class _ThisProcess:
    """This process's own metrics, when no multiprocess directory is configured."""

    def collect(self) -> Iterator[Metric]:
        yield from REGISTRY.collect()


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def _counting() -> CollectorRegistry:
    """The engine's counters and histograms: every process's, or this process's own."""
    registry = CollectorRegistry(auto_describe=False)
    if multiprocess_dir():
        MultiProcessCollector(registry)
    else:
        registry.register(_ThisProcess())
    return registry


def counter_samples() -> list[Sample]:
    """Every sample of the engine's counters and histograms (every process's), read once."""
    return [sample for family in _counting().collect() for sample in family.samples]


def totals(samples: list[Sample], name: str, *by: str) -> dict[tuple[str, ...], float]:
    """The samples named ``name`` (e.g. ``recovery_step_attempts_total``) added up by the labels
    ``by``: ``{(label value, …): total}``. The numbers ``/metrics`` serves, for the dashboard."""
    found: dict[tuple[str, ...], float] = {}
    for sample in samples:
        if sample.name == name:
            key = tuple(sample.labels.get(label, "") for label in by)
            found[key] = found.get(key, 0.0) + sample.value
    return found


def registry() -> CollectorRegistry:
    """A registry for one scrape (nothing is kept between scrapes)."""
    registry = _counting()
    registry.register(DatabaseGauges())
    return registry


def render() -> bytes:
    """The text a scraper reads at ``/metrics``."""
    return generate_latest(registry())
