# A run's events are indexed in chain (id) order: the chain trigger's look-up of the run's last
# event was a scan of the run's whole history through (run, at, id), O(n) per insert.
# The new index is built before the old one goes, so a run's events are never unindexed.

from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('recovery', '0016_in_flight_window'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddIndex(
            model_name='auditevent',
            index=models.Index(fields=['run', 'id'], name='audit_run_id_idx'),
        ),
        migrations.RemoveIndex(
            model_name='auditevent',
            name='audit_run_at_idx',
        ),
    ]
