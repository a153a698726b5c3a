from __future__ import annotations

import pytest
from django.db import connection

from recovery import clock as engine_clock
from recovery.testing import MovableClock
from tests.support import receivers

# Fixtures shared by more than one test package (the model server, the sandbox's client).
pytest_plugins = ["tests.support.model_server", "tests.support.sandbox_api"]


def pytest_configure(config):
    # CI's SQLite pass deselects these (.ci/run), having run them in its PostgreSQL pass.
    config.addinivalue_line(
        "markers",
        "storage_agnostic: the storage engine CI picks cannot change it (a browser test of what the page "
        "itself does, or a test that brings its own databases); CI runs it in its PostgreSQL pass only",
    )


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
