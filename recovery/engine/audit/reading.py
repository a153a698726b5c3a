"""Reading an export back for ``verify_audit --file``: JSON Lines, or CSV (told apart by CSV's
header line).

A CSV cell that a spreadsheet would run as a formula was written with a leading ``'``
(recovery.engine.audit.export); a stored value may itself start with ``'`` and such a
character, so the ``'`` is ambiguous. Each event's hash settles it: of the readings of its
ambiguous cells (stripped first), the one whose hash matches is the stored event; when none
does, the event was changed. The CSV trailer names a run by its ``workflow_id`` cell as written,
so the events are grouped by that cell too.
"""

from __future__ import annotations

import csv
import itertools
import json
from collections.abc import Iterable, Iterator

from recovery.engine.audit.chain import Event, event_hash
from recovery.engine.audit.export import COLUMNS, FORMULA_TRIGGERS
from recovery.engine.audit.trailer import RUN, TOTAL, ReadExport, read_jsonl

HEADER = ",".join(COLUMNS)
_AMBIGUOUS_LIMIT = 8  # cells of one event read both ways at most (2**8 readings)


def read_export(lines: Iterable[str]) -> ReadExport:
    """An export's events and trailer, whichever its format; ``ValueError`` (one line) otherwise."""
    lines = iter(lines)
    first = next(lines, "")
    rest = itertools.chain([first], lines)
    if first.rstrip("\r\n") == HEADER:
        return read_csv(rest)
    return read_jsonl(rest)


def read_csv(lines: Iterator[str]) -> ReadExport:
    export = ReadExport()
    reader = csv.reader(lines)
    next(reader)  # the header
    for row in reader:
        number = reader.line_num
        if not row:
            continue
        try:
            if export.total is not None:
                raise ValueError("a row after the trailer's total, which ends an export")
            if len(row) != len(COLUMNS):
                raise ValueError(f"{len(row)} cells, not {len(COLUMNS)}")
            if row[0] == RUN:
                if row[1] in export.runs:
                    raise ValueError("a trailer row for a run twice")
                export.runs[row[1]] = {"events": json.loads(row[8])["events"], "last_hash": row[11]}
            elif row[0] == TOTAL:
                total = json.loads(row[8])
                export.total = {name: total[name] for name in ("runs", "events", "filters")}
            elif export.runs:
                raise ValueError("an event after the trailer")
            else:
                event = _event(row)
                export.chains.setdefault(row[1], []).append(event)
                export.last[row[1]] = event
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"line {number} is not a row of a CSV audit export ({exc})") from None
    for chain in export.chains.values():
        chain.sort(key=lambda event: event.id)
    return export


def _event(row: list[str]) -> Event:
    event_id, prev_hash, digest = int(row[9]), row[10], row[11]
    readings = [[cell[1:], cell] if cell[:1] == "'" and cell[1:2] in FORMULA_TRIGGERS else [cell] for cell in row[1:9]]
    if sum(len(options) > 1 for options in readings) > _AMBIGUOUS_LIMIT:
        readings = [options[:1] for options in readings]
    for values in itertools.product(*readings):
        candidate = (row[0], *values)
        if event_hash(prev_hash, candidate) == digest:
            return Event(event_id, candidate, prev_hash, digest)
    return Event(event_id, (row[0], *(options[0] for options in readings)), prev_hash, digest)
