import os
import signal
import threading

from django.core.management.base import CommandError

from recovery.engine import failpoints
from recovery.engine.loop import run_forever
from recovery.management.base import RecoveryCommand
from recovery.observability import alerts


class Command(RecoveryCommand):
    help = (
        "Run the embedded executor: advance due runs in-process (no broker), and sweep the alerts on stuck runs. "
        "SIGTERM (or Ctrl-C) stops it between two runs; it then marks itself stopped."
    )

    def add_arguments(self, parser):
        parser.add_argument("--until-idle", action="store_true", help="return once nothing is due now")
        parser.add_argument("--poll", type=float, default=1.0, help="seconds between polls when idle")

    def handle(self, *args, until_idle, poll, **options):
        try:
            failpoints.parse(os.environ.get("RECOVERY_FAILPOINTS", ""))
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        stop = threading.Event()
        main = threading.current_thread() is threading.main_thread()  # only it may handle signals
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set()) if main else None
        try:
            advanced = run_forever(
                until_idle=until_idle, poll_seconds=poll, on_beat=alerts.sweep, should_stop=stop.is_set
            )
        except KeyboardInterrupt:
            self.stderr.write("run_executor: interrupted; stopped")
            return
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)
        if stop.is_set():
            self.stdout.write(f"advanced {advanced} run(s); stopped (SIGTERM)")
            return
        self.stdout.write(f"advanced {advanced} run(s); nothing is due now")
