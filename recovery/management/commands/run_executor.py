from django.core.management.base import BaseCommand

from recovery.executor import run_forever


class Command(BaseCommand):
    help = "Run the embedded executor: advance due runs in-process (no broker)."

    def add_arguments(self, parser):
        parser.add_argument("--until-idle", action="store_true", help="return once nothing is due now")
        parser.add_argument("--poll", type=float, default=1.0, help="seconds between polls when idle")

    def handle(self, *args, until_idle, poll, **options):
        advanced = run_forever(until_idle=until_idle, poll_seconds=poll)
        self.stdout.write(f"advanced {advanced} run(s); nothing is due now")
