import os

from django.core.management.base import CommandError

from recovery.management.base import RecoveryCommand
from recovery.supervisor import Supervisor, manage_argv


class Command(RecoveryCommand):
    help = (
        "Run the console (runserver) and the embedded executor (run_executor) side by side, as make run does: "
        "an executor that dies is reported on stderr and restarted; Ctrl-C or SIGTERM stops both (exit 0)."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--addr",
            default=f"127.0.0.1:{os.environ.get('PORT', '8000')}",
            help="the console's address (default 127.0.0.1:$PORT, PORT defaulting to 8000)",
        )

    def handle(self, *args, addr, **options):
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise CommandError(f"--addr: expected HOST:PORT, got {addr!r}")
        supervisor = Supervisor(
            executor=manage_argv("run_executor"), console=manage_argv("runserver", addr, "--noreload")
        )
        status = supervisor.run()
        if status:
            raise SystemExit(status)
