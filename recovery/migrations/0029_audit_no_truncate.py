# The audit table refuses TRUNCATE too (PostgreSQL; SQLite has no TRUNCATE): an owner's or a
# granted role's TRUNCATE emptied the trail, and verify_audit then found nothing to fail.

from django.db import migrations

from recovery.engine.audit import chain as audit_chain


def install(apps, schema_editor):
    # A new database has it already: migration 0013 installs chain.install_statements.
    if schema_editor.connection.vendor == "postgresql":
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(f"DROP TRIGGER IF EXISTS recovery_audit_no_truncate ON {audit_chain.TABLE}")
            cursor.execute(audit_chain.NO_TRUNCATE)


def uninstall(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(f"DROP TRIGGER IF EXISTS recovery_audit_no_truncate ON {audit_chain.TABLE}")


class Migration(migrations.Migration):
    dependencies = [
        ("recovery", "0028_executors"),
    ]

    operations = [
        migrations.RunPython(install, uninstall),
    ]
