"""Head anchors: each run's event count and last hash, kept outside the database.

A hash chain shows a change inside a run's trail, not events cut from its end, and whoever
can disable the database's triggers (the tables' owner) can cut them. ``export_audit
--anchors`` writes, for every run (or one), how many events it has and the id and hash of the
last one: a small file (about 200 bytes a run) to keep where the database's owner cannot
write — a ticket, a write-once bucket, an auditor's mailbox. ``verify_audit --anchors FILE``
then checks, besides every chain, that each anchored run still exists, has at least that many
events, and that its event at that position is the anchored one (same id, same hash). Events
appended since are fine: an older anchor stays valid for as long as the trail is whole.

JSON Lines::

    {"anchor":"run","workflow_id":"invoice:acme:INV-1001","events":12,"last_event_id":345,"last_hash":"…"}
    {"anchor":"total","runs":1,"events":12,"at":"2026-12-03T18:00:00.000000+00:00"}

Each run's line is read in one statement (its count and last event agree); runs are read a
batch at a time, so memory stays flat whatever the number of runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from django.db import connection as default_connection

from recovery import clock
from recovery.engine.audit.chain import RUN_TABLE, TABLE, Verification, at_text, run_batches

_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


@dataclass(frozen=True)
class Anchor:
    workflow_id: str
    events: int
    last_event_id: int
    last_hash: str


def stored_anchors(*, run: str | None = None, runs_per_batch: int = 1000, connection=None) -> Iterator[Anchor]:
    """Every run's anchor (runs without events have none), in run order."""
    connection = connection or default_connection
    quote = connection.ops.quote_name
    for ids in run_batches(run=run, runs_per_batch=runs_per_batch, connection=connection):
        with connection.cursor() as cursor:
            cursor.execute(
                f"""SELECT r.workflow_id, c.n, e.id, e.hash
                FROM (SELECT run_id, count(*) AS n, max(id) AS last FROM {quote(TABLE)}
                      WHERE run_id IN ({", ".join(["%s"] * len(ids))}) GROUP BY run_id) AS c
                JOIN {quote(TABLE)} AS e ON e.id = c.last JOIN {quote(RUN_TABLE)} AS r ON r.id = c.run_id
                ORDER BY r.id""",
                ids,
            )
            rows = cursor.fetchall()
        for workflow_id, count, last_id, digest in rows:
            yield Anchor(workflow_id, count, last_id, digest)


def anchor_lines(anchors: Iterable[Anchor]) -> Iterator[str]:
    runs = events = 0
    for anchor in anchors:
        runs, events = runs + 1, events + anchor.events
        yield (
            f'{{"anchor":"run","workflow_id":{_json(anchor.workflow_id)},"events":{anchor.events},'
            f'"last_event_id":{anchor.last_event_id},"last_hash":"{anchor.last_hash}"}}\n'
        )
    yield f'{{"anchor":"total","runs":{runs},"events":{events},"at":"{at_text(clock.now())}"}}\n'


def read_anchors(lines: Iterable[str]) -> list[Anchor]:
    """The anchors of an anchors file; ``ValueError`` (one line) for anything else, or for a
    file without its total (cut)."""
    anchors: list[Anchor] = []
    total = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            if total is not None:
                raise ValueError("a line after the total, which ends the file")
            row = json.loads(line)
            kind = row.get("anchor")
            if kind == "run":
                anchor = Anchor(row["workflow_id"], row["events"], row["last_event_id"], row["last_hash"])
                if not (isinstance(anchor.workflow_id, str) and isinstance(anchor.events, int) and anchor.events > 0):
                    raise ValueError("not a run's anchor")
                anchors.append(anchor)
            elif kind == "total":
                total = (row["runs"], row["events"])
            else:
                raise ValueError(f"unknown line {kind!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"line {number} is not a line of an audit anchors file ({exc})") from None
    if total != (len(anchors), sum(anchor.events for anchor in anchors)):
        raise ValueError("the file does not end with the total of its anchors: it was cut or edited")
    return anchors


@dataclass(frozen=True)
class AnchorProblem:
    workflow_id: str
    problem: str

    def __str__(self) -> str:
        return f"run {self.workflow_id}: {self.problem}"


def check_anchors(anchors: list[Anchor], *, batch: int = 500, connection=None) -> Verification:
    """Each anchored run against the database: it exists, and its event at the anchored position
    is the anchored one. ``runs`` counts the anchored runs checked."""
    connection = connection or default_connection
    quote = connection.ops.quote_name
    result = Verification()
    for start in range(0, len(anchors), batch):
        part = anchors[start : start + batch]
        marks = ", ".join(["%s"] * len(part))
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT workflow_id FROM {quote(RUN_TABLE)} WHERE workflow_id IN ({marks})",
                [anchor.workflow_id for anchor in part],
            )
            existing = {row[0] for row in cursor.fetchall()}
            cursor.execute(
                f"""SELECT r.workflow_id, e.id, e.hash,
                    (SELECT count(*) FROM {quote(TABLE)} AS x WHERE x.run_id = e.run_id AND x.id <= e.id)
                FROM {quote(TABLE)} AS e JOIN {quote(RUN_TABLE)} AS r ON r.id = e.run_id WHERE e.id IN ({marks})""",
                [anchor.last_event_id for anchor in part],
            )
            found = {row[1]: row for row in cursor.fetchall()}
        for anchor in part:
            result.runs += 1
            result.events += anchor.events
            result.add(_problem(anchor, anchor.workflow_id in existing, found.get(anchor.last_event_id)))
    return result


def _problem(anchor: Anchor, exists: bool, found: tuple | None) -> AnchorProblem | None:
    if not exists:
        return AnchorProblem(anchor.workflow_id, f"the run is gone (anchored with {anchor.events} events)")
    where = f"its event {anchor.events} (id {anchor.last_event_id})"
    if found is None:
        return AnchorProblem(anchor.workflow_id, f"{where} is gone: events were cut from its trail")
    workflow_id, _, digest, position = found
    if workflow_id != anchor.workflow_id or position != anchor.events:
        return AnchorProblem(
            anchor.workflow_id, f"{where} is now event {position} of run {workflow_id}: its trail was rewritten"
        )
    if digest != anchor.last_hash:
        return AnchorProblem(anchor.workflow_id, f"{where} no longer has the anchored hash: its trail was rewritten")
    return None
