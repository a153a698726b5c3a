# "Failed, effects stand" (a stuck cause) is a flag the failure sets, counted from a partial
# index: as a query over each failed run's steps it cost every list page ~140 ms at a million
# runs. Runs that failed before this migration are marked when a completed step of theirs has a
# remote reference (a model step's "decision vN" is not an effect elsewhere).

from django.db import migrations, models


def mark_failed_runs(apps, schema_editor):
    WorkflowRun = apps.get_model("recovery", "WorkflowRun")
    StepExecution = apps.get_model("recovery", "StepExecution")
    made = (
        StepExecution.objects.filter(run__state="failed", state="succeeded")
        .exclude(remote_ref="")
        .exclude(remote_ref__startswith="decision v")
        .values("run_id")
    )
    WorkflowRun.objects.filter(state="failed", pk__in=made).update(effects_stand=True)


class Migration(migrations.Migration):

    dependencies = [
        ('recovery', '0019_search_trigram'),
    ]

    operations = [
        migrations.AddField(
            model_name='historicalworkflowrun',
            name='effects_stand',
            field=models.BooleanField(blank=True, default=None, null=True),
        ),
        migrations.AddField(
            model_name='workflowrun',
            name='effects_stand',
            field=models.BooleanField(blank=True, default=None, null=True),
        ),
        migrations.AddIndex(
            model_name='workflowrun',
            index=models.Index(
                condition=models.Q(("effects_stand", True), ("state", "failed")),
                fields=["id"],
                name="run_failed_effects_idx",
            ),
        ),
        migrations.RunPython(mark_failed_runs, migrations.RunPython.noop),
    ]
