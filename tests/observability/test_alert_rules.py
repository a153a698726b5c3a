"""The metric table and the example Prometheus rules of docs/operating.md name the metrics that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import Counter, Histogram

from recovery.engine import metrics
from recovery.observability.exposition import DatabaseGauges

OPERATING = (Path(__file__).resolve().parents[2] / "docs" / "operating.md").read_text()
METRIC = re.compile(r"\brecovery_[a-z_]+")


def exposed() -> dict[str, set[str]]:
    """Every metric family this product exposes, by its name, with the sample names it has."""
    families: dict[str, set[str]] = {}
    for instrument in vars(metrics).values():
        if isinstance(instrument, Counter):
            families[instrument._name] = {f"{instrument._name}_total"}
        elif isinstance(instrument, Histogram):
            families[instrument._name] = {f"{instrument._name}_{s}" for s in ("bucket", "sum", "count")}
    for family in DatabaseGauges().collect():
        families[family.name] = {family.name}
    return families


def rules() -> list[dict]:
    block = OPERATING.split("An example rule file for Prometheus", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    groups = yaml.safe_load(block)["groups"]
    return [rule for group in groups for rule in group["rules"]]


@pytest.mark.django_db
def test_the_example_rules_load_and_use_only_exposed_samples():
    samples = set().union(*exposed().values())
    found = rules()
    assert found and all(set(rule) <= {"alert", "expr", "for", "labels", "annotations"} for rule in found)
    for rule in found:
        names = set(METRIC.findall(rule["expr"]))
        assert names and names <= samples, f"{rule['alert']}: {names - samples}"


@pytest.mark.django_db
def test_the_table_lists_every_metric_once():
    table = OPERATING.split("## Metrics and health", 1)[1].split("\n\n`/healthz`", 1)[0]
    listed = re.findall(r"^\| `(recovery_[a-z_]+)` \|", table, flags=re.MULTILINE)
    documented = {name.removesuffix("_total") for name in listed}
    assert len(listed) == len(documented)
    assert documented == set(exposed())
