import sys
from pathlib import Path

from django.core.management.base import CommandError

from recovery.engine.audit import anchors as audit_anchors
from recovery.engine.audit import chain as audit_chain
from recovery.engine.audit import reading as audit_reading
from recovery.engine.audit import trailer as audit_trailer
from recovery.management.base import RecoveryCommand
from recovery.models import WorkflowRun


class Command(RecoveryCommand):
    help = (
        "Walk every run's audit hash chain (or one run's, or an export's) and check that each trail is "
        "whole: every run has events, starts with its start and ends in its state; an export matches its trailer; "
        "with --anchors, every anchored run still holds its anchored last event. Exits 0 when all hold, 1 otherwise."
    )

    def add_arguments(self, parser):
        parser.add_argument("--run", help="one run, by workflow id")
        parser.add_argument(
            "--file",
            help="verify an export (export_audit, JSON Lines or CSV) instead of the database: its chains "
            "and its trailer (a period's export: a run's events before its first are taken as given)",
        )
        parser.add_argument(
            "--without-trailer",
            action="store_true",
            help="with --file: accept an export that has no trailer (one written before exports had one), "
            "checking its chains only",
        )
        parser.add_argument(
            "--anchors",
            metavar="FILE",
            help="also check the head anchors in FILE (export_audit --anchors): every anchored run still has "
            "its anchored event at its anchored position",
        )

    def handle(self, *args, run, file, without_trailer, anchors, **options):
        if file is not None and anchors is not None:
            raise CommandError("--anchors checks the database: give it without --file")
        if without_trailer and file is None:
            raise CommandError("--without-trailer goes with --file")
        note = ""
        if file is not None:
            export = _read(Path(file), audit_reading.read_export)
            result = audit_trailer.verify_export(export, run=run, trailer=not without_trailer)
            if without_trailer and export.total is None:
                note = " (no trailer: whether events were cut from the file is not checked)"
        else:
            if run is not None and not WorkflowRun.objects.filter(workflow_id=run).exists():
                raise CommandError(f"no run {run!r}")
            result = audit_chain.verify_stored(run=run)
            if anchors is not None:
                anchored = _read(Path(anchors), audit_anchors.read_anchors)
                if run is not None:
                    anchored = [anchor for anchor in anchored if anchor.workflow_id == run]
                checked = audit_anchors.check_anchors(anchored)
                result.broken_runs += checked.broken_runs
                result.first = result.first or checked.first
                note = f"; {checked.runs} anchored runs hold their anchors"
        failure = result.failure()
        if failure is not None:
            self.stderr.write(failure)
            sys.exit(1)
        self.stdout.write(f"audit chain intact: {result.events} events in {result.runs} runs{note}")


def _read(path: Path, read):
    try:
        with path.open(encoding="utf-8", newline="") as lines:  # CSV: a CR or LF inside a quoted cell stays
            return read(lines)
    except OSError as exc:
        raise CommandError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CommandError(f"{str(path)!r} is not UTF-8 text") from None
    except ValueError as exc:
        raise CommandError(f"{path}: {exc}") from None
