# Audit events become a hash chain per run, computed by the database, and append-only there.

from django.db import migrations, models

from recovery.engine.audit import chain as audit_chain

BATCH = 5000


def backfill(apps, schema_editor):
    """Chain the events already stored, run by run, in id order (before the triggers exist)."""
    connection = schema_editor.connection
    table = connection.ops.quote_name(audit_chain.TABLE)
    changed = []
    with connection.cursor() as cursor:
        for chain in audit_chain.stored_chains(connection=connection):
            prev = ""
            for event in chain:
                digest = audit_chain.event_hash(prev, event.values)
                changed.append([prev, digest, event.id])
                prev = digest
            if len(changed) >= BATCH:
                cursor.executemany(f'UPDATE {table} SET "prev_hash" = %s, "hash" = %s WHERE "id" = %s', changed)
                changed = []
        if changed:
            cursor.executemany(f'UPDATE {table} SET "prev_hash" = %s, "hash" = %s WHERE "id" = %s', changed)


def install(apps, schema_editor):
    with schema_editor.connection.cursor() as cursor:
        for statement in audit_chain.install_statements(schema_editor.connection.vendor):
            cursor.execute(statement)


def uninstall(apps, schema_editor):
    with schema_editor.connection.cursor() as cursor:
        for statement in audit_chain.uninstall_statements(schema_editor.connection.vendor):
            cursor.execute(statement)


class Migration(migrations.Migration):
    dependencies = [
        ("recovery", "0012_canonical_audit_json"),
    ]

    operations = [
        migrations.AddField(
            model_name="auditevent",
            name="prev_hash",
            field=models.CharField(blank=True, db_default="", default="", editable=False, max_length=64),
        ),
        migrations.AddField(
            model_name="auditevent",
            name="hash",
            field=models.CharField(blank=True, db_default="", default="", editable=False, max_length=64),
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
        migrations.RunPython(install, uninstall),
    ]
