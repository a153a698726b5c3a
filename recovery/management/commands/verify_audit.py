import sys
from pathlib import Path

from django.core.management.base import CommandError

from recovery.engine.audit import chain as audit_chain
from recovery.management.base import RecoveryCommand
from recovery.models import WorkflowRun


class Command(RecoveryCommand):
    help = (
        "Walk every run's audit hash chain (or one run's, or a JSON Lines export's) and report the first "
        "broken link. Exits 0 when every chain is intact, 1 when one is broken."
    )

    def add_arguments(self, parser):
        parser.add_argument("--run", help="one run, by workflow id")
        parser.add_argument(
            "--file",
            help="verify a JSON Lines export (export_audit --format jsonl) instead of the database; "
            "a run's events before the export's first are taken as given",
        )

    def handle(self, *args, run, file, **options):
        if file is not None:
            result = self._verify_file(Path(file), run)
        else:
            if run is not None and not WorkflowRun.objects.filter(workflow_id=run).exists():
                raise CommandError(f"no run {run!r}")
            result = audit_chain.verify(audit_chain.stored_chains(run=run))
        if result.first is not None:
            self.stderr.write(
                f"audit chain broken in {result.broken_runs} of {result.runs} runs; first broken link: {result.first}"
            )
            sys.exit(1)
        self.stdout.write(f"audit chain intact: {result.events} events in {result.runs} runs")

    def _verify_file(self, path: Path, run: str | None) -> audit_chain.Verification:
        try:
            with path.open(encoding="utf-8") as lines:
                chains = list(audit_chain.exported_chains(lines))
        except OSError as exc:
            raise CommandError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise CommandError(f"{str(path)!r} is not UTF-8 text") from None
        except ValueError as exc:
            raise CommandError(f"{path}: {exc}") from None
        if run is not None:
            chains = [chain for chain in chains if chain[0].workflow_id == run]
        return audit_chain.verify(chains, complete=False)
