import json

from recovery.management.base import RecoveryCommand
from recovery.observability import health


class Command(RecoveryCommand):
    help = (
        "Readiness for a container probe, as /readyz: prints the checks as JSON and exits 0 when "
        "ready, 1 (with one line on stderr) when not."
    )

    def handle(self, *args, **options):
        report = health.ready()
        self.stdout.write(json.dumps(report, indent=2))
        if report["status"] != "ok":
            failed = ", ".join(f"{name}: {c['detail']}" for name, c in report["checks"].items() if not c["ok"])
            self.stderr.write(f"not ready: {failed}")
            raise SystemExit(1)
