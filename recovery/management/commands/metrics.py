from recovery.management.base import RecoveryCommand
from recovery.observability import exposition


class Command(RecoveryCommand):
    help = (
        "Print the metrics /metrics serves (Prometheus text format): every process's counters when "
        "PROMETHEUS_MULTIPROC_DIR is set, and the gauges read from the database."
    )

    def handle(self, *args, **options):
        self.stdout.write(exposition.render().decode(), ending="")
