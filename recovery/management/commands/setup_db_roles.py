"""``manage.py setup_db_roles --owner NAME --runtime NAME [--print-sql]``: the least-privilege
database roles (PostgreSQL), created or brought up to date — run it again after every migrate.

- The **owner** migrates (``DATABASE_URL`` of ``manage.py migrate``) and owns every table,
  sequence and function of the schema: existing ones are handed over to it.
- The **runtime** role is what the console, the executors and the workers connect as: it may
  read and write the engine's tables (``SELECT, INSERT, UPDATE, DELETE``; ``USAGE, SELECT`` on
  sequences), but only ``SELECT`` and ``INSERT`` on the audit trail (``recovery_auditevent``) and
  the account changes' trail (``recovery_accountevent``), and only ``SELECT`` on
  ``django_migrations``. It owns nothing, so it can neither ``TRUNCATE`` nor
  disable the audit table's triggers. Default privileges grant it the same on every table the
  owner creates later; a migration that creates the audit table again would give it full rights
  there, which the next ``setup_db_roles`` takes back.

Passwords come from ``RECOVERY_DB_OWNER_PASSWORD`` and ``RECOVERY_DB_RUNTIME_PASSWORD``, or are
asked for on a terminal; a new role without one gets a generated password, printed once; an
existing role keeps its own. ``--print-sql`` prints the statements instead, for a DBA to run
with ``psql -v owner_password=… -v runtime_password=… -f roles.sql`` (no password is printed).
Run it as a role that may create roles and owns the tables so far (the set-up's superuser).
"""

from __future__ import annotations

import getpass
import os
import re
import secrets
import sys
from collections.abc import Callable

from django.core.management.base import CommandError
from django.db import connections, transaction

from recovery.accounts import TABLE as ACCOUNT_TABLE
from recovery.engine.audit.chain import TABLE as AUDIT_TABLE
from recovery.management.base import RecoveryCommand

NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
PASSWORD_ENV = {"owner": "RECOVERY_DB_OWNER_PASSWORD", "runtime": "RECOVERY_DB_RUNTIME_PASSWORD"}
MIGRATIONS_TABLE = "django_migrations"
APPEND_ONLY = (AUDIT_TABLE, ACCOUNT_TABLE)  # the audit trail, and the accounts' own (recovery.accounts)
ROLE_OPTIONS = "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS"


def _ident(name: str) -> str:
    return f'"{name}"'  # NAME allows no quote: nothing to escape


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def role_statements(owner: str, runtime: str, database: str, password: Callable[[str, str], str | None]) -> list[str]:
    """The statements, in order. ``password(kind, name)`` is the ``PASSWORD`` clause's value
    (already SQL: a literal, or a psql variable) or None to keep the role's own."""
    o, r, db = _ident(owner), _ident(runtime), _ident(database)
    statements = []
    for kind, name in (("owner", owner), ("runtime", runtime)):
        statements.append(
            f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = {_literal(name)}) "
            f"THEN CREATE ROLE {_ident(name)}; END IF; END $$"
        )
        value = password(kind, name)
        statements.append(f"ALTER ROLE {_ident(name)} WITH {ROLE_OPTIONS}" + (f" PASSWORD {value}" if value else ""))
    statements += [
        f"REVOKE {o} FROM {r}",  # the runtime role inherits nothing of the owner's
        f"GRANT CONNECT, TEMPORARY, CREATE ON DATABASE {db} TO {o}",  # CREATE: a trusted extension (pg_trgm)
        f"GRANT CONNECT, TEMPORARY ON DATABASE {db} TO {r}",
        "REVOKE CREATE ON SCHEMA public FROM PUBLIC",
        f"GRANT USAGE, CREATE ON SCHEMA public TO {o}",
        f"GRANT USAGE ON SCHEMA public TO {r}",
        # Hand every object of the schema to the owner (sequences owned by a column follow their table).
        f"""DO $$ DECLARE item record; BEGIN
    FOR item IN SELECT c.relname, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
          AND NOT EXISTS (SELECT FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                          AND d.deptype IN ('a', 'i', 'e'))
    LOOP
        EXECUTE format('ALTER %s %I OWNER TO {o}',
            CASE item.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
                ELSE 'TABLE' END, item.relname);
    END LOOP;
    FOR item IN SELECT p.oid::regprocedure AS signature FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = 'public' AND p.prokind = 'f' AND NOT EXISTS (
            SELECT FROM pg_depend d WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e')
    LOOP
        EXECUTE format('ALTER FUNCTION %s OWNER TO {o}', item.signature);
    END LOOP;
END $$""",
        f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {r}",
        f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {r}",
        f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {r}",
        f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {r}",
        f"ALTER DEFAULT PRIVILEGES FOR ROLE {o} IN SCHEMA public GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {r}",
        f"ALTER DEFAULT PRIVILEGES FOR ROLE {o} IN SCHEMA public GRANT USAGE, SELECT ON SEQUENCES TO {r}",
    ]
    for table, kept in (*((name, "SELECT, INSERT") for name in APPEND_ONLY), (MIGRATIONS_TABLE, "SELECT")):
        statements += [
            f"DO $$ BEGIN IF to_regclass({_literal('public.' + table)}) IS NOT NULL THEN "
            f"REVOKE ALL ON {table} FROM {r}; GRANT {kept} ON {table} TO {r}; END IF; END $$"
        ]
    return statements


class Command(RecoveryCommand):
    help = (
        "Create or update (idempotent) the database roles: an owner that migrates and owns the tables, and a "
        "runtime role that reads and writes them but may only read and append to the audit trail (PostgreSQL)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--owner", required=True, help="the owner role (migrates, owns the tables)")
        parser.add_argument("--runtime", required=True, help="the role the application runs as")
        parser.add_argument("--database", default="default", help="the Django database alias (default: default)")
        parser.add_argument(
            "--print-sql",
            action="store_true",
            help="print the statements (a psql script; passwords as :'owner_password' and :'runtime_password') "
            "instead of running them",
        )

    def handle(self, *args, owner, runtime, database, print_sql, **options):
        if database not in connections:
            raise CommandError(f"no database {database!r} in DATABASES")
        connection = connections[database]
        if connection.vendor != "postgresql":
            raise CommandError(f"setup_db_roles is for PostgreSQL; {database!r} is {connection.vendor}")
        for name in (owner, runtime):
            if not NAME.fullmatch(name):
                raise CommandError(f"role name {name!r}: use lower-case letters, digits and _ (63 at most)")
        if owner == runtime:
            raise CommandError("the owner and the runtime role must be two roles")
        name = connection.settings_dict["NAME"]
        if print_sql:
            statements = role_statements(owner, runtime, name, lambda kind, _: f":'{kind}_password'")
            self.stdout.write(f"-- setup_db_roles for database {name}: psql -v owner_password=… -v runtime_password=…")
            self.stdout.write("\n".join(f"{statement};" for statement in statements))
            return
        with connection.cursor() as cursor:
            cursor.execute("SELECT rolname FROM pg_roles WHERE rolname IN (%s, %s)", [owner, runtime])
            existing = {row[0] for row in cursor.fetchall()}
        generated: dict[str, str] = {}

        def password(kind: str, role: str) -> str | None:
            value = os.environ.get(PASSWORD_ENV[kind]) or self._ask(role, role in existing)
            if not value and role not in existing:
                value = generated[role] = secrets.token_urlsafe(24)
            return _literal(value) if value else None

        statements = role_statements(owner, runtime, name, password)

        with transaction.atomic(using=database), connection.cursor() as cursor:
            for statement in statements:
                cursor.execute(statement)
        for role, value in generated.items():
            self.stdout.write(f"generated password for role {role} (shown once): {value}")
        self.stdout.write(
            f"roles ready on {name}: migrate as {owner}, run the application as {runtime} "
            f"(it may only read and append to {AUDIT_TABLE})"
        )

    def _ask(self, role: str, exists: bool) -> str:
        if not sys.stdin.isatty():
            return ""
        hint = "keep its password" if exists else "generate one"
        first = getpass.getpass(f"password for role {role} (empty: {hint}): ")
        if first and getpass.getpass(f"password for role {role}, again: ") != first:
            raise CommandError(f"the two passwords for role {role} differ")
        return first
