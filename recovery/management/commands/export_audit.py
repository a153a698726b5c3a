import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from django.core.management.base import CommandError

from recovery.engine.audit import anchors as audit_anchors
from recovery.engine.audit import export as exports
from recovery.management.base import RecoveryCommand


class Command(RecoveryCommand):
    help = (
        "Export the audit trail as CSV or JSON Lines, streamed to stdout or --output FILE, ending with a trailer "
        "(per run: events held, last hash); or, with --anchors, each run's head anchor (its event count and last hash)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--format", default="csv", help="csv (default) or jsonl")
        parser.add_argument("--run", help="one run, by workflow id")
        parser.add_argument("--since", help="ISO 8601 date or datetime, inclusive (a date is midnight UTC)")
        parser.add_argument("--until", help="ISO 8601 date or datetime, exclusive (a date is midnight UTC)")
        parser.add_argument("--workflow", help="a workflow name")
        parser.add_argument("--actor", help="a username, or executor")
        parser.add_argument("--action", help="an audit action (start, resume, terminate, …)")
        parser.add_argument(
            "--anchors",
            action="store_true",
            help="write each run's head anchor (event count, last event id and hash; JSON Lines) instead of events: "
            "keep the file outside the database, check it with verify_audit --anchors FILE",
        )
        parser.add_argument(
            "--output", help="write to FILE, readable by you only, replaced only once the export is complete"
        )

    def handle(self, *args, output, anchors, **options):
        if anchors:
            return self._anchors(output, options)
        try:
            filters = exports.parse_filters({name: options[name] for name in exports.PARAMETERS})
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if output is None:
            for chunk in exports.export_chunks(filters):
                self.stdout.write(chunk, ending="")
            return
        count = exports.ExportCount()
        _write_atomically(Path(output), exports.export_chunks(filters, count=count))
        self.stdout.write(f"exported {count.events} audit events to {output}")

    def _anchors(self, output, options):
        given = [f"--{name}" for name in exports.PARAMETERS if name not in ("run", "format") and options[name]]
        if given:
            raise CommandError(f"--anchors takes no {', '.join(given)}: it anchors every run, or one with --run")
        try:
            run = exports.parse_filters({"run": options["run"]}).run
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        lines = audit_anchors.anchor_lines(audit_anchors.stored_anchors(run=run))
        if output is None:
            for line in lines:
                self.stdout.write(line, ending="")
            return
        _write_atomically(Path(output), lines)
        self.stdout.write(f"wrote the head anchors to {output}: keep it outside the database")


def _write_atomically(path: Path, chunks: Iterable[str]) -> None:
    """Write ``chunks`` to a temporary file beside ``path``, then rename it over ``path``: a
    failed export never leaves a partial file behind."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise CommandError(f"cannot write {str(path)!r}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as file:
            file.writelines(chunks)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise CommandError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
        raise
