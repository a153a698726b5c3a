from __future__ import annotations

import pytest
from django.db import connection

from recovery import clock as engine_clock
from recovery.testing import MovableClock
from tests.support import receivers

# Fixtures shared by more than one test package (the model server, the sandbox's client).
pytest_plugins = ["tests.support.model_server", "tests.support.sandbox_api"]


def pytest_configure(config):
    # CI's SQLite pass deselects these (.ci/run), having run them in its PostgreSQL pass. A test
    # that uses none of the suite's databases is marked by pytest_collection_modifyitems below.
    config.addinivalue_line(
        "markers",
        "storage_agnostic: the storage engine CI picks cannot change it (a browser test of what the page "
        "itself does, a test that brings its own databases, or one that uses no database of the suite's); "
        "CI runs it in its PostgreSQL pass only",
    )


# A test that asks for none of these (and has no django_db mark) cannot reach the suite's
# databases (pytest-django refuses it): the storage engine cannot change it.
_DATABASE_FIXTURES = frozenset(
    {"db", "transactional_db", "django_db_reset_sequences", "django_db_serialized_rollback", "live_server"}
)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    for item in items:  # before -m deselects by the marks added here
        if not _uses_database(item):
            item.add_marker("storage_agnostic")
    yield  # pytest-django orders them as Django does: rolled back, then transactional, then no database
    # Then the slowest first within that order, each module's tests kept together: under
    # `--dist worksteal` the fast ones fill the workers around them instead of one long test ending
    # the run alone. Tests that use no database go first (nothing of theirs can leak into another's).
    items.sort(key=_place)


def _uses_database(item) -> bool:
    return item.get_closest_marker("django_db") is not None or bool(_DATABASE_FIXTURES & set(item.fixturenames))


def _place(item) -> int:
    slow = item.get_closest_marker("slow") is not None
    if not _uses_database(item):
        if item.nodeid.startswith("tests/slow/test_readme_walkthrough.py"):
            return 0  # minutes: the longest of all
        return 1 if slow else 2
    marker = item.get_closest_marker("django_db")
    transactional = bool(marker and (marker.kwargs.get("transaction") or marker.kwargs.get("reset_sequences")))
    if not transactional and not {"transactional_db", "live_server"} & set(item.fixturenames):
        return 3  # rolled back: before every transactional test, as Django runs them
    if slow:
        return 4
    return 5 if item.nodeid.startswith("tests/browser/") else 6


def pytest_report_header(config):
    from tests.slow.test_dispute_crash import CASES
    from tests.support import rotation

    return rotation.header("dispute crash rotation (tests/slow/test_dispute_crash.py)", CASES, connection.vendor)


@pytest.fixture
def clock(monkeypatch) -> MovableClock:
    c = MovableClock()
    monkeypatch.setattr(engine_clock, "now", c.now)
    return c


@pytest.fixture(autouse=True)
def _clean_receivers():
    receivers.clear()
    receivers.MODEL_SCRIPT.clear()
    receivers.AGENT_SCRIPT.clear()
    yield
    receivers.clear()
    receivers.MODEL_SCRIPT.clear()
    receivers.AGENT_SCRIPT.clear()


@pytest.fixture
def undeploy(monkeypatch):
    """``undeploy(name, version)`` takes one version of a workflow out of this process's registry
    for the test, as a deploy without its module would (recovery.registry)."""
    from recovery import registry

    def remove(name: str, version: int) -> None:
        versions = dict(registry._REGISTRY[name])
        del versions[version]
        monkeypatch.setitem(registry._REGISTRY, name, versions)

    return remove


@pytest.fixture
def postgres_only():
    if connection.vendor != "postgresql":
        pytest.skip("needs real concurrency: runs on PostgreSQL (set DATABASE_URL=postgres://…)")


@pytest.fixture(autouse=True, scope="session")
def _flushable_audit():
    """A transactional test ends with a flush: on SQLite a DELETE of every row, on PostgreSQL a
    TRUNCATE; the audit table's append-only triggers refuse both. Lift that one trigger for the
    flush only (and the account events' likewise)."""
    from django.db import connections
    from django.test import TransactionTestCase

    from recovery import accounts
    from recovery.engine.audit import chain as audit_chain

    original = TransactionTestCase._fixture_teardown
    table = audit_chain.TABLE
    # (lift, restore) per engine; the account events (recovery.accounts) are append-only too.
    lift = {
        "sqlite": [
            ("DROP TRIGGER IF EXISTS recovery_audit_no_delete", audit_chain.SQLITE_NO_DELETE),
            ("DROP TRIGGER IF EXISTS recovery_account_no_delete", accounts.SQLITE_NO_DELETE),
        ],
        "postgresql": [
            (
                f"ALTER TABLE {table} DISABLE TRIGGER recovery_audit_no_truncate",
                f"ALTER TABLE {table} ENABLE TRIGGER recovery_audit_no_truncate",
            ),
            (
                f"ALTER TABLE {accounts.TABLE} DISABLE TRIGGER recovery_account_no_truncate",
                f"ALTER TABLE {accounts.TABLE} ENABLE TRIGGER recovery_account_no_truncate",
            ),
        ],
    }

    def teardown(self):
        engines = [connections[alias] for alias in self._databases_names(include_mirrors=False)]
        engines = [c for c in engines if c.alias == "default" and c.vendor in lift]
        for c in engines:
            with c.cursor() as cursor:
                for statement, _ in lift[c.vendor]:
                    cursor.execute(statement)
        try:
            original(self)
        finally:
            for c in engines:
                with c.cursor() as cursor:
                    for _, statement in lift[c.vendor]:
                        cursor.execute(statement)

    TransactionTestCase._fixture_teardown = teardown
    yield
    TransactionTestCase._fixture_teardown = original
