"""The workflows this process has, by (name, version).

A deploy may keep a workflow's previous definition beside the current one until its runs have
drained (``workflows/invoice/v1.py`` beside ``workflow.py``): both register here. New runs start
on the current version (the highest registered); each run executes, to the end, on the version it
started on (``WorkflowRun.workflow_version``). An executor claims only runs whose (name, version)
it has (``deployed_filter``), so old and new workers side by side each finish their own runs.

Plain data: nothing here imports the engine, the counts or the console, so all of them can read it.
"""

from __future__ import annotations

from typing import Any, Protocol

from django.db.models import Q

# A recovery.workflow.Workflow: that module registers its workflows here, so this one names
# it without importing it.
Workflow = Any


class _Run(Protocol):
    workflow_name: str
    workflow_version: int


class VersionNotDeployed(LookupError):
    """A run's (name, version) is not registered in this process: not a fault of the run, a
    deployment that lacks its definition. The run waits, stuck for "version not deployed"."""


# name -> version -> definition
_REGISTRY: dict[str, dict[int, Workflow]] = {}


def register(workflow: Workflow) -> None:
    versions = _REGISTRY.setdefault(workflow.name, {})
    existing = versions.get(workflow.version)
    if existing is not None and existing is not workflow:
        raise ValueError(f"workflow {workflow.name!r} v{workflow.version} is already registered")
    versions[workflow.version] = workflow


def get_workflow(name: str, version: int | None = None) -> Workflow:
    """The definition of ``name`` at ``version`` (None: the current one, which new runs start on).
    Raises LookupError for a name not registered, VersionNotDeployed for a version this process
    lacks."""
    versions = _REGISTRY.get(name)
    if not versions:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise LookupError(f"unknown workflow {name!r} (registered: {known})")
    if version is None:
        return versions[max(versions)]
    try:
        return versions[version]
    except KeyError:
        raise VersionNotDeployed(
            f"{name} v{version} is not deployed here (this deployment has {versions_text(name)})"
        ) from None


def workflow_of(run: _Run) -> Workflow:
    """The definition a run executes on: the version it started on (or was moved to)."""
    return get_workflow(run.workflow_name, run.workflow_version)


def has(name: str, version: int) -> bool:
    return version in _REGISTRY.get(name, {})


def current_version(name: str) -> int | None:
    versions = _REGISTRY.get(name)
    return max(versions) if versions else None


def versions_of(name: str) -> list[int]:
    """The versions of ``name`` this process has, oldest first."""
    return sorted(_REGISTRY.get(name, {}))


def versions_text(name: str) -> str:
    """ "v2", "v1 and v2", or "no version" of ``name``: how a sentence names what is deployed."""
    versions = [f"v{v}" for v in versions_of(name)]
    if not versions:
        return "no version"
    return versions[0] if len(versions) == 1 else f"{', '.join(versions[:-1])} and {versions[-1]}"


def all_workflows() -> list[Workflow]:
    """The current version of every workflow, by name."""
    return [get_workflow(name) for name in sorted(_REGISTRY) if _REGISTRY[name]]


def all_versions() -> list[Workflow]:
    """Every registered (name, version), by name then version."""
    return [_REGISTRY[name][v] for name in sorted(_REGISTRY) for v in sorted(_REGISTRY[name])]


def version_number(text: str) -> int | None:
    """A workflow version as written in a URL, a form or a command ("2"): up to 9 ASCII digits,
    else None. Each surface says what it does with anything else."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else None


def deployed() -> tuple[tuple[str, tuple[int, ...]], ...]:
    """What this process has, as a hashable value: ((name, (versions…)), …), by name."""
    return tuple((name, tuple(sorted(_REGISTRY[name]))) for name in sorted(_REGISTRY) if _REGISTRY[name])


def deployed_filter(pairs: tuple[tuple[str, tuple[int, ...]], ...] | None = None, prefix: str = "") -> Q:
    """Runs whose (name, version) this process has (``pairs``: ``deployed()`` by default);
    ``prefix`` reaches the run from another model ("run__")."""
    pairs = deployed() if pairs is None else pairs
    if not pairs:
        return Q(**{f"{prefix}pk__in": []})
    condition = Q()
    for name, versions in pairs:
        fields: dict[str, Any] = {f"{prefix}workflow_name": name}
        if len(versions) == 1:
            fields[f"{prefix}workflow_version"] = versions[0]
        else:
            fields[f"{prefix}workflow_version__in"] = list(versions)
        condition |= Q(**fields)
    return condition
