# The runs list searches by substring, case-insensitively (UPPER(col::text) LIKE UPPER('%q%'),
# Django's icontains), over workflow ids and the steps' remote references and compensation
# references, and by prefix over idempotency keys (a range on the keys' unique index: no index
# of its own, since every index on the steps is written again by each checkpoint).
#
# A run's workflow id is copied, once, into recovery_runsearch by a trigger on the run's insert
# (bulk inserts too): the run's own row is rewritten by every checkpoint, and a trigram index on
# it would cost every checkpoint an index entry (measured: about a sixth of the executor's steps
# per second). On PostgreSQL, pg_trgm GIN indexes on those expressions keep the search off a
# scan of every row; the step indexes are partial (a step gets an entry once it has a
# reference, not at every checkpoint before). SQLite scans: it is the embedded default, for
# small installations.

import django.db.models.deletion
from django.db import migrations, models

POSTGRESQL = [
    """CREATE FUNCTION recovery_run_search() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO recovery_runsearch (run_id, workflow_id) VALUES (NEW.id, NEW.workflow_id);
        RETURN NULL;
    END $$""",
    "CREATE TRIGGER recovery_run_search AFTER INSERT ON recovery_workflowrun "
    "FOR EACH ROW EXECUTE FUNCTION recovery_run_search()",
    "INSERT INTO recovery_runsearch (run_id, workflow_id) SELECT id, workflow_id FROM recovery_workflowrun",
    "CREATE EXTENSION IF NOT EXISTS pg_trgm",
    "CREATE INDEX run_search_trgm ON recovery_runsearch USING gin (UPPER(workflow_id::text) gin_trgm_ops)",
    "CREATE INDEX step_remote_ref_trgm ON recovery_stepexecution "
    "USING gin (UPPER(remote_ref::text) gin_trgm_ops) WHERE remote_ref <> ''",
    "CREATE INDEX step_compensation_ref_trgm ON recovery_stepexecution "
    "USING gin (UPPER(compensation_ref::text) gin_trgm_ops) WHERE compensation_ref <> ''",
]
POSTGRESQL_BACK = [
    "DROP INDEX IF EXISTS step_compensation_ref_trgm",
    "DROP INDEX IF EXISTS step_remote_ref_trgm",
    "DROP TRIGGER IF EXISTS recovery_run_search ON recovery_workflowrun",
    "DROP FUNCTION IF EXISTS recovery_run_search()",
]
SQLITE = [
    "CREATE TRIGGER recovery_run_search AFTER INSERT ON recovery_workflowrun BEGIN "
    "INSERT INTO recovery_runsearch (run_id, workflow_id) VALUES (NEW.id, NEW.workflow_id); END",
    "INSERT INTO recovery_runsearch (run_id, workflow_id) SELECT id, workflow_id FROM recovery_workflowrun",
]
SQLITE_BACK = ["DROP TRIGGER IF EXISTS recovery_run_search"]


def _run(by_vendor):
    def run(apps, schema_editor):
        for statement in by_vendor.get(schema_editor.connection.vendor, []):
            schema_editor.execute(statement)

    return run


class Migration(migrations.Migration):
    dependencies = [("recovery", "0018_guards")]

    operations = [
        migrations.CreateModel(
            name="RunSearch",
            fields=[
                (
                    "run",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="+",
                        serialize=False,
                        to="recovery.workflowrun",
                    ),
                ),
                ("workflow_id", models.CharField(max_length=255)),
            ],
            options={"db_table": "recovery_runsearch"},
        ),
        migrations.RunPython(
            _run({"postgresql": POSTGRESQL, "sqlite": SQLITE}),
            _run({"postgresql": POSTGRESQL_BACK, "sqlite": SQLITE_BACK}),
        ),
    ]
