"""The export's trailer: what the export holds, per run and in total, after its last event.

Chained events show a change, an insertion or a removal *inside* what an export holds, not a
run whose first or last events, or whose whole trail, are missing from the file. So every export
(``export_audit``, the console's download) ends with a trailer that says, for each run it holds,
how many of its events it holds and the hash of the last one in the file, then the totals and
the filters the export was made with. ``verify_audit --file`` checks the trailer against the
events: a file cut anywhere, or with a run's first or last events, or a whole run, removed,
fails. An export of a period (``since``/``until``) describes the events it holds, so it
verifies as well.

JSON Lines, one object per line after the events::

    {"trailer":"run","workflow_id":"…","events":12,"last_hash":"…"}
    {"trailer":"total","runs":1,"events":12,"filters":{"since":"2026-12-01T00:00:00.000000+00:00"}}

CSV, rows of the export's twelve columns after the events, told apart by their ``at`` cell (an
event's is a date): ``trailer`` — ``workflow_id`` (written as in the event rows, formula-like
cells prefixed), ``after`` ``{"events":12}``, ``hash`` the run's last event's;
then ``trailer_total`` — ``after`` ``{"events":…,"filters":{…},"runs":…}``.

The trailer is as strong as the file it ends: it shows a cut or a lost run, not someone who
rewrites the file's trailer with its events. Against that, and against events cut from the end of
a run in the database itself, keep the head anchors (``recovery.engine.audit.anchors``) outside
the database. Memory: the trailer keeps one entry per run exported (about 250 bytes each).
"""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from recovery.engine.audit.chain import HASHED, Event, Verification, first_break
from recovery.fields import canonical_json

RUN = "trailer"  # the CSV ``at`` cell of a run's trailer row
TOTAL = "trailer_total"  # and of the totals' row
_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


class Tally:
    """What an export wrote, per run, as it streams: how many events, and the hash of the run's
    last event in the file. ``key`` is the run's ``workflow_id`` as the format writes it
    (``decode`` turns a raw key into that, once per run, when the trailer is written).

    On PostgreSQL the database writes the lines; reading each run's key and hash back out of
    them is done a chunk at a time with bytes methods, ``Counter`` and ``dict.update`` (C loops),
    not per line in Python: it costs the export about 0.5 µs an event."""

    def __init__(self, decode: Callable[[Any], str] | None = None):
        self.counts: Counter[Any] = Counter()
        self.last: dict[Any, Any] = {}  # key -> the hash of its last event so far (first-seen order)
        self.decode = decode

    def add(self, key: Any, digest: Any) -> None:
        self.counts[key] += 1
        self.last[key] = digest

    def add_copied(self, data: bytes, rows: list[Any], csv_format: bool) -> None:
        """Count COPY's ``rows`` (one line each, LF-terminated), joined in ``data``."""
        if self.decode is None:
            self.decode = _csv_cell if csv_format else _json_string
        if csv_format:
            # Split the chunk into its rows; a cell holding a LF: row by row.
            lines = data.split(b"\n")[:-1] if data.count(b"\n") == len(rows) else [bytes(row)[:-1] for row in rows]
            keys = [_csv_raw_cell(line) for line in lines]
            digests = [line[-64:] for line in lines]  # the last cell: a hex digest, never quoted
        else:
            lines = data.split(b"\n")[:-1]  # a JSON line holds no raw LF
            # The workflow id's JSON string, as written: it ends at the first ,"workflow": (a JSON
            # string holds no raw quote); a line ends with ,"hash":"<64 hex>"}.
            keys = [line[line.index(b'"workflow_id":') + 14 : line.index(b',"workflow":')] for line in lines]
            digests = [line[-66:-2] for line in lines]
        self.counts.update(keys)
        self.last.update(zip(keys, digests, strict=True))

    def entries(self) -> Iterator[tuple[str, int, str]]:
        decode = self.decode or (lambda key: key)
        counts = self.counts
        for key, digest in self.last.items():
            yield decode(key), counts[key], digest if isinstance(digest, str) else digest.decode()


def _csv_raw_cell(row: bytes) -> bytes:
    """The second cell (``workflow_id``) of a CSV row, as written (quoted or not)."""
    start = row.index(b",") + 1
    if row[start : start + 1] != b'"':
        return row[start : row.index(b",", start)]
    at = start + 1
    while True:
        quote = row.index(b'"', at)
        if row[quote + 1 : quote + 2] != b'"':
            return row[start : quote + 1]
        at = quote + 2


def _csv_cell(raw: bytes) -> str:
    return next(csv.reader(io.StringIO(raw.decode(), newline="")))[0] if raw else ""


def _json_string(raw: bytes) -> str:
    return json.loads(raw)


def trailer_lines(csv_format: bool, tally: Tally, filters: dict[str, str]) -> Iterator[str]:
    """The trailer's lines (CSV: records), after an export's events."""
    runs = events = 0
    if csv_format:
        writerow = csv.writer(_Echo()).writerow
        for workflow_id, count, digest in tally.entries():
            runs, events = runs + 1, events + count
            yield writerow([RUN, workflow_id, "", "", "", "", "", "", _json({"events": count}), "", "", digest])
        total = canonical_json({"events": events, "filters": filters, "runs": runs})
        yield writerow([TOTAL, "", "", "", "", "", "", "", total, "", "", ""])
        return
    for workflow_id, count, digest in tally.entries():
        runs, events = runs + 1, events + count
        yield f'{{"trailer":"run","workflow_id":{_json(workflow_id)},"events":{count},"last_hash":"{digest}"}}\n'
    yield f'{{"trailer":"total","runs":{runs},"events":{events},"filters":{canonical_json(filters)}}}\n'


class _Echo:
    def write(self, value: str) -> str:
        return value


# --- reading and checking an export ------------------------------------------------------


@dataclass(frozen=True)
class FileProblem:
    """Something wrong with an export as a whole, or with one run in it."""

    problem: str

    def __str__(self) -> str:
        return self.problem


@dataclass
class ReadExport:
    """A JSON Lines export as read: each run's events in chain order, and its trailer."""

    chains: dict[str, list[Event]] = field(default_factory=dict)
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)  # the trailer's run lines
    total: dict[str, Any] | None = None
    last: dict[str, Event] = field(default_factory=dict)  # each run's last event in the file


def read_jsonl(lines: Iterable[str]) -> ReadExport:
    """Events and trailer of a JSON Lines export; ``ValueError`` (one line) for a line that is
    neither, an event after the trailer, or anything after its total."""
    export = ReadExport()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if export.total is not None:
            raise ValueError(f"line {number} follows the trailer's total, which ends an export")
        try:
            row = json.loads(line)
            kind = row.get("trailer") if isinstance(row, dict) else None
            if kind is None:
                if export.runs:
                    raise ValueError("an event after the trailer")
                event = _event(row)
                export.chains.setdefault(event.workflow_id, []).append(event)
                export.last[event.workflow_id] = event
            elif kind == "run":
                entry = {name: row[name] for name in ("events", "last_hash")}
                if not isinstance(row["workflow_id"], str) or row["workflow_id"] in export.runs:
                    raise ValueError("a trailer line for no run, or for a run twice")
                export.runs[row["workflow_id"]] = entry
            elif kind == "total":
                export.total = {name: row[name] for name in ("runs", "events", "filters")}
            else:
                raise ValueError(f"unknown trailer line {kind!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"line {number} is not an event of a JSON Lines audit export ({exc})") from None
    for chain in export.chains.values():
        chain.sort(key=lambda event: event.id)
    return export


def _event(row: dict[str, Any]) -> Event:
    values = []
    for column in HASHED:
        value = row[column]
        if column in ("before", "after"):
            value = canonical_json(value)
        elif not isinstance(value, str):
            raise TypeError(f"{column} is not a string")
        values.append(value)
    return Event(int(row["event_id"]), tuple(values), row["prev_hash"], row["hash"])


# Filters after which a run's exported events are no longer one stretch of its chain.
GAPPING_FILTERS = ("actor", "action")


def verify_export(export: ReadExport, *, run: str | None = None, trailer: bool = True) -> Verification:
    """The export's chains, and (``trailer``) that they are what its trailer says it holds.
    Without ``trailer`` an export that has none is checked for its links only."""
    result = Verification()
    chains = export.chains if run is None else {k: v for k, v in export.chains.items() if k == run}
    if trailer and export.total is None:
        result.runs, result.events = len(chains), sum(map(len, chains.values()))
        result.add(FileProblem("the export has no trailer: it was cut, or written before exports had one"))
        return result
    filters = (export.total or {}).get("filters") or {}
    gapping = [name for name in GAPPING_FILTERS if name in filters]
    if gapping:
        result.add(
            FileProblem(
                f"the export is filtered by {' and '.join(gapping)}: its runs' chains have gaps by design "
                "(export a run, a workflow or a period to verify)"
            )
        )
        return result
    complete = "since" not in filters  # a later period starts inside its runs' chains
    for workflow_id, chain in chains.items():
        result.runs += 1
        result.events += len(chain)
        result.add(
            first_break(chain, complete=complete) or (_against_trailer(export, workflow_id, chain) if trailer else None)
        )
    if trailer:
        missing = [workflow_id for workflow_id in export.runs if workflow_id not in export.chains]
        for workflow_id in missing if run is None else [w for w in missing if w == run]:
            result.runs += 1
            result.add(
                FileProblem(
                    f"run {workflow_id}: the trailer lists {export.runs[workflow_id]['events']} events, the export none"
                )
            )
        if run is None:
            total = export.total or {}
            held = (len(export.runs), sum(entry["events"] for entry in export.runs.values()))
            if (total.get("runs"), total.get("events")) != held:
                result.add(
                    FileProblem(
                        f"the trailer's total says {total.get('events')} events in {total.get('runs')} runs, "
                        f"its run lines {held[1]} in {held[0]}: trailer lines were removed"
                    )
                )
    return result


def _against_trailer(export: ReadExport, workflow_id: str, chain: Sequence[Event]) -> FileProblem | None:
    entry = export.runs.get(workflow_id)
    if entry is None:
        return FileProblem(f"run {workflow_id}: its events are not in the trailer")
    last = export.last[workflow_id]
    if entry["events"] != len(chain):
        return FileProblem(
            f"run {workflow_id}: the export holds {len(chain)} of its events, the trailer says {entry['events']} "
            "(events were cut from the file)"
        )
    if entry["last_hash"] != last.hash:
        return FileProblem(
            f"run {workflow_id}: its last event in the export, {last.id}, is not the trailer's "
            "(events were cut from the file)"
        )
    return None
