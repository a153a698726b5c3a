"""``setup_db_roles``: a migrating owner and a runtime role that may read and append to the audit
trail, but neither change, delete, truncate it nor switch its triggers off (issue 34, item 2)."""

from __future__ import annotations

import uuid
from io import StringIO

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from recovery.engine.transitions import run_start
from recovery.models import AuditEvent

AUDIT = "recovery_auditevent"


def setup_roles(*args: str) -> str:
    out = StringIO()
    call_command("setup_db_roles", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def as_role(role: str, password: str) -> psycopg.Connection:
    settings = connection.settings_dict
    return psycopg.connect(
        host="127.0.0.1",
        port=settings["PORT"] or 5432,
        dbname=settings["NAME"],
        user=role,
        password=password,
        autocommit=True,
    )


def refused(conn: psycopg.Connection, statement: str, params=()) -> str:
    with pytest.raises(psycopg.errors.InsufficientPrivilege) as refusal:
        conn.execute(statement, params)
    return str(refusal.value)


@pytest.mark.django_db(transaction=True)  # another connection, as the runtime role, must see the roles
def test_the_runtime_role_reads_and_appends_the_trail_and_can_do_nothing_else_to_it(postgres_only, monkeypatch):
    run = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "roles"})[0]
    suffix = uuid.uuid4().hex[:8]
    owner, runtime = f"rc_test_owner_{suffix}", f"rc_test_app_{suffix}"
    monkeypatch.setenv("RECOVERY_DB_OWNER_PASSWORD", "owner-pw")
    monkeypatch.setenv("RECOVERY_DB_RUNTIME_PASSWORD", "runtime-pw")
    try:
        out = setup_roles("--owner", owner, "--runtime", runtime)
        assert "owner-pw" not in out and "runtime-pw" not in out
        setup_roles("--owner", owner, "--runtime", runtime)  # idempotent: a second run changes nothing and succeeds
        with connection.cursor() as cursor:
            cursor.execute("SELECT tableowner FROM pg_tables WHERE tablename = %s", [AUDIT])
            assert cursor.fetchone()[0] == owner

        with as_role(runtime, "runtime-pw") as app:
            app.execute(
                f"INSERT INTO {AUDIT} (run_id, step_name, actor, action, reason, before, after, at)"
                " VALUES (%s, '', 'executor', 'note', 'as the runtime role', '{}', '{}', now())",
                [run.pk],
            )
            [(reason, digest)] = app.execute(
                f"SELECT reason, hash FROM {AUDIT} WHERE run_id = %s AND action = 'note'", [run.pk]
            ).fetchall()
            assert reason == "as the runtime role" and len(digest) == 64  # the chain trigger ran for it
            app.execute("UPDATE recovery_workflowrun SET status_reason = 'touched' WHERE id = %s", [run.pk])

            # What the owner (or a role granted ALL) could do, and the runtime role cannot:
            assert "permission denied" in refused(app, f"TRUNCATE {AUDIT}")
            assert "permission denied" in refused(app, "TRUNCATE recovery_workflowrun CASCADE")
            assert "permission denied" in refused(app, f"DELETE FROM {AUDIT}")
            assert "permission denied" in refused(app, f"UPDATE {AUDIT} SET reason = 'rewritten'")
            assert "must be owner" in refused(app, f"ALTER TABLE {AUDIT} DISABLE TRIGGER ALL")
            assert "must be owner" in refused(app, f"ALTER TABLE {AUDIT} DISABLE TRIGGER recovery_audit_append_only")
            assert "must be owner" in refused(app, f"DROP TABLE {AUDIT}")
            assert "permission denied" in refused(app, "DELETE FROM django_migrations")
            assert "permission denied" in refused(app, "DELETE FROM recovery_accountevent")  # append-only too

        with as_role(owner, "owner-pw") as owner_conn:  # the owner migrates: it may create tables ...
            owner_conn.execute("CREATE TABLE rc_test_later (id serial PRIMARY KEY, note text)")
        with as_role(runtime, "runtime-pw") as app:  # ... which default privileges open to the runtime role
            app.execute("INSERT INTO rc_test_later (note) VALUES ('later') RETURNING id")
            assert app.execute("SELECT count(*) FROM rc_test_later").fetchone()[0] == 1

        assert AuditEvent.objects.filter(run=run, action="note").count() == 1
        assert "intact" in _verify()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE IF EXISTS rc_test_later")
            for role in (owner, runtime):
                cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
                if cursor.fetchone():
                    cursor.execute(f'REASSIGN OWNED BY "{role}" TO CURRENT_USER')
                    cursor.execute(f'DROP OWNED BY "{role}"')
                    cursor.execute(f'DROP ROLE "{role}"')


def _verify() -> str:
    out = StringIO()
    call_command("verify_audit", stdout=out, stderr=StringIO())
    return out.getvalue()


@pytest.mark.django_db
def test_print_sql_shows_the_statements_without_a_password_and_changes_nothing(postgres_only, monkeypatch):
    monkeypatch.setenv("RECOVERY_DB_RUNTIME_PASSWORD", "never-shown")
    out = setup_roles("--owner", "rc_owner", "--runtime", "rc_app", "--print-sql")
    assert "never-shown" not in out
    assert "PASSWORD :'runtime_password'" in out and "PASSWORD :'owner_password'" in out
    assert f'REVOKE ALL ON {AUDIT} FROM "rc_app"; GRANT SELECT, INSERT ON {AUDIT} TO "rc_app"' in out
    assert 'ALTER DEFAULT PRIVILEGES FOR ROLE "rc_owner" IN SCHEMA public GRANT SELECT, INSERT, UPDATE, DELETE' in out
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_roles WHERE rolname IN ('rc_owner', 'rc_app')")
        assert cursor.fetchone()[0] == 0


@pytest.mark.django_db
def test_bad_role_names_are_refused_with_one_line(postgres_only):
    with pytest.raises(CommandError, match="role name 'x\";drop'"):
        call_command("setup_db_roles", "--owner", 'x";drop', "--runtime", "app")
    with pytest.raises(CommandError, match="must be two roles"):
        call_command("setup_db_roles", "--owner", "same", "--runtime", "same")


@pytest.mark.django_db
def test_on_sqlite_it_says_it_is_for_postgresql():
    if connection.vendor != "sqlite":
        pytest.skip("the SQLite refusal")
    with pytest.raises(CommandError, match="^setup_db_roles is for PostgreSQL; 'default' is sqlite$"):
        call_command("setup_db_roles", "--owner", "owner", "--runtime", "app")
