"""A trail that was emptied or cut does not verify (issue 34, item 2): ``verify_audit`` checks that
every run has its events from its start to the state it is in; an export's trailer says what it
holds, so a file with a run's first or last events, or a whole run, cut out fails
``verify_audit --file``; head anchors kept outside the database catch events cut from a run's end."""

from __future__ import annotations

import csv
import json
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from recovery.engine.audit import chain as audit_chain
from recovery.models import AuditEvent, RunState, WorkflowRun
from tests.engine.test_audit_integrity import start, verify, without_triggers
from tests.support.engine import drive

pytestmark = pytest.mark.django_db


@pytest.fixture
def two_runs(clock) -> tuple[WorkflowRun, WorkflowRun]:
    first, second = drive(start("chain-1"), clock), drive(start("chain-2"), clock)
    assert first.state == second.state == RunState.COMPLETED
    return first, second


def sql(statement: str, params=()) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


def with_triggers() -> None:
    with connection.cursor() as cursor:
        for statement in audit_chain.install_statements(connection.vendor):
            cursor.execute(statement)


def export(path: Path, *args: str) -> list[str]:
    call_command("export_audit", "--format", "jsonl", "--output", str(path), *args, stdout=StringIO())
    return path.read_text().splitlines(keepends=True)


def event_lines(lines: list[str], workflow_id: str) -> list[int]:
    return [
        i for i, line in enumerate(lines) if '"trailer"' not in line and json.loads(line)["workflow_id"] == workflow_id
    ]


# --- the database -----------------------------------------------------------------------


def test_an_emptied_trail_does_not_verify(two_runs):
    without_triggers()  # as the tables' owner could (a TRUNCATE, refused since migration 0029, did the same)
    sql("DELETE FROM recovery_auditevent")

    code, out, err = verify()

    assert (code, out) == (1, "")  # it said "audit chain intact: 0 events in 0 runs"
    assert err.count("\n") == 1 and err.startswith(
        "audit chain broken in 2 of 2 runs; first problem: run order:t:chain-1"
    )
    assert "it has no audit events (it is completed): its trail was emptied" in err


def test_a_trail_that_does_not_begin_with_the_runs_start_does_not_verify(two_runs):
    run = two_runs[0]
    without_triggers()
    sql("DELETE FROM recovery_auditevent WHERE run_id = %s", [run.pk])
    with_triggers()  # a new chain, intact link by link, but not from the run's start
    AuditEvent.objects.create(run=run, at=run.updated_at, actor="executor", action="complete", after={"run": run.state})
    assert audit_chain.verify(audit_chain.stored_chains()).first is None  # the links alone hold

    code, _, err = verify()

    assert code == 1 and f"run {run.workflow_id}: its first event is event " in err and "not its start" in err


def test_a_trail_cut_at_its_end_does_not_verify(two_runs):
    run = two_runs[1]
    last = run.audit_events.order_by("-id").first()
    assert last.after["run"] == "completed"  # the checkpoint that completed it
    without_triggers()
    sql("DELETE FROM recovery_auditevent WHERE id = %s", [last.id])
    assert audit_chain.verify(audit_chain.stored_chains()).first is None  # a prefix of a chain is a chain

    code, _, err = verify()

    assert code == 1 and f"run {run.workflow_id}: it is completed but its last event recording its state" in err
    assert "says running: the events after it are missing" in err
    assert verify("--run", two_runs[0].workflow_id)[0] == 0


def test_runs_at_rest_in_every_state_verify(clock):
    """No false alarm on a healthy trail (the workflows' own tests end with verify_audit on runs in every state)."""
    drive(start("done"), clock)
    start("pending")
    assert verify() == (0, f"audit chain intact: {AuditEvent.objects.count()} events in 2 runs\n", "")


# --- an export's trailer ----------------------------------------------------------------


def test_an_export_ends_with_a_trailer_that_verify_checks(two_runs, tmp_path):
    path = tmp_path / "audit.jsonl"
    lines = export(path)
    *_, first_run, second_run, total = map(json.loads, lines)
    for run, line in zip(two_runs, (first_run, second_run), strict=True):
        last = run.audit_events.order_by("-id").first()
        assert line == {
            "trailer": "run",
            "workflow_id": run.workflow_id,
            "events": run.audit_events.count(),
            "last_hash": last.hash,
        }
    assert total == {"trailer": "total", "runs": 2, "events": AuditEvent.objects.count(), "filters": {}}
    assert verify("--file", str(path))[0] == 0

    # CSV carries the same, in rows of its own columns (told apart by their ``at``).
    out = StringIO()
    call_command("export_audit", "--format", "csv", stdout=out)
    *_, first_row, _, total_row = csv.reader(StringIO(out.getvalue(), newline=""))
    assert first_row[:2] == ["trailer", two_runs[0].workflow_id] and first_row[11] == first_run["last_hash"]
    assert json.loads(first_row[8]) == {"events": first_run["events"]}
    assert total_row[0] == "trailer_total" and json.loads(total_row[8]) == {
        "events": total["events"],
        "filters": {},
        "runs": 2,
    }


def test_a_run_whose_clock_stepped_back_still_verifies(two_runs, tmp_path):
    """The trailer's last event is the run's last line in the file (export order is by time):
    an event written after a clock step back comes earlier in the file, and is no false alarm."""
    run = two_runs[0]
    first = run.audit_events.order_by("id").first()
    AuditEvent.objects.create(run=run, at=first.at, actor="executor", action="note", after={})
    path = tmp_path / "audit.jsonl"
    export(path)
    assert verify("--file", str(path))[0] == 0
    assert verify()[0] == 0


@pytest.mark.parametrize("cut", ["first", "last", "run", "run_and_its_trailer", "trailer"])
def test_an_export_with_events_cut_out_does_not_verify(two_runs, tmp_path, cut):
    path = tmp_path / "audit.jsonl"
    lines = export(path)
    run = two_runs[0].workflow_id
    mine = event_lines(lines, run)
    drop = {
        "first": mine[:2],
        "last": mine[-2:],
        "run": mine,
        "run_and_its_trailer": [
            *mine,
            next(i for i, line in enumerate(lines) if f'"trailer":"run","workflow_id":"{run}"' in line),
        ],
        "trailer": [i for i, line in enumerate(lines) if '"trailer"' in line],
    }[cut]
    path.write_text("".join(line for i, line in enumerate(lines) if i not in drop))

    code, out, err = verify("--file", str(path))

    assert (code, out) == (1, "") and err.count("\n") == 1
    expected = {
        "first": "the run's first event has a prev_hash",
        "last": f"run {run}: the export holds {len(mine) - 2} of its events, the trailer says {len(mine)}",
        "run": f"run {run}: the trailer lists {len(mine)} events, the export none",
        "run_and_its_trailer": "trailer lines were removed",
        "trailer": "the export has no trailer: it was cut, or written before exports had one",
    }[cut]
    assert expected in err


def test_an_export_without_a_trailer_is_checked_for_its_links_only_when_asked(two_runs, tmp_path):
    path = tmp_path / "old.jsonl"
    lines = export(path)
    path.write_text("".join(line for line in lines if '"trailer"' not in line))  # as exports were written before

    assert verify("--file", str(path))[0] == 1
    code, out, err = verify("--file", str(path), "--without-trailer")
    assert (code, err) == (0, "") and "(no trailer: whether events were cut from the file is not checked)" in out


def test_an_export_of_a_period_verifies_and_a_cut_in_it_does_not(two_runs, tmp_path):
    events = list(AuditEvent.objects.order_by("at", "id"))
    path = tmp_path / "period.jsonl"
    lines = export(path, f"--since={events[len(events) // 2].at.isoformat()}")
    assert json.loads(lines[-1])["filters"] == {"since": events[len(events) // 2].at.isoformat(timespec="microseconds")}
    assert verify("--file", str(path))[0] == 0

    mine = event_lines(lines, two_runs[1].workflow_id)
    path.write_text("".join(line for i, line in enumerate(lines) if i != mine[-1]))
    code, _, err = verify("--file", str(path))
    assert code == 1 and "the trailer says" in err


def test_an_export_filtered_by_actor_is_not_a_chain_and_says_so(two_runs, tmp_path):
    path = tmp_path / "actor.jsonl"
    export(path, "--actor=executor")
    code, _, err = verify("--file", str(path))
    assert code == 1 and "the export is filtered by actor: its runs' chains have gaps by design" in err


# --- head anchors -----------------------------------------------------------------------


def anchors(path: Path, *args: str) -> str:
    out = StringIO()
    call_command("export_audit", "--anchors", "--output", str(path), *args, stdout=out)
    return out.getvalue()


def test_head_anchors_hold_while_the_trail_grows_and_fail_once_it_is_cut(two_runs, clock, tmp_path):
    path = tmp_path / "anchors.jsonl"
    assert "keep it outside the database" in anchors(path)
    first, second, total = map(json.loads, path.read_text().splitlines())
    last = two_runs[0].audit_events.order_by("-id").first()
    assert first == {
        "anchor": "run",
        "workflow_id": two_runs[0].workflow_id,
        "events": two_runs[0].audit_events.count(),
        "last_event_id": last.id,
        "last_hash": last.hash,
    }
    assert (second["workflow_id"], total["runs"], total["events"]) == (
        two_runs[1].workflow_id,
        2,
        AuditEvent.objects.count(),
    )
    code, out, _ = verify("--anchors", str(path))
    assert code == 0 and "2 anchored runs hold their anchors" in out

    drive(start("later"), clock)  # a run and events appended since: the anchors still hold
    assert verify("--anchors", str(path))[0] == 0

    # Cut the two last events of the first run (its state still agrees: only anchors see it).
    cut = list(two_runs[0].audit_events.order_by("-id")[:2])
    without_triggers()
    sql("DELETE FROM recovery_auditevent WHERE id IN (%s, %s)", [cut[0].id, cut[1].id])
    with_triggers()
    AuditEvent.objects.create(
        run=two_runs[0], at=cut[0].at, actor="executor", action="complete", after={"run": "completed"}
    )
    assert verify()[0] == 0  # the chain and the run's state agree again

    code, _, err = verify("--anchors", str(path))
    assert code == 1 and f"run {two_runs[0].workflow_id}: its event {first['events']} (id {last.id}) is gone" in err


def test_an_anchored_run_that_is_gone_fails(two_runs, tmp_path):
    path = tmp_path / "anchors.jsonl"
    anchors(path, "--run", two_runs[1].workflow_id)
    assert len(path.read_text().splitlines()) == 2
    assert verify("--anchors", str(path))[0] == 0
    # A run anchored yesterday that the database no longer has (renamed here: a run cannot be deleted
    # while it has events, and its events cannot be deleted).
    path.write_text(path.read_text().replace(two_runs[1].workflow_id, "order:t:gone"))

    code, _, err = verify("--anchors", str(path))

    assert code == 1 and "run order:t:gone: the run is gone (anchored with" in err


def test_a_cut_or_foreign_anchors_file_is_refused_with_one_line(two_runs, tmp_path):
    path = tmp_path / "anchors.jsonl"
    anchors(path)
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))
    with pytest.raises(CommandError, match="does not end with the total of its anchors"):
        call_command("verify_audit", "--anchors", str(path))
    with pytest.raises(CommandError, match="--anchors takes no --since"):
        call_command("export_audit", "--anchors", "--since", "2026-01-01", stdout=StringIO())
    assert RunState.COMPLETED == two_runs[0].state


# --- a CSV export verifies too -----------------------------------------------------------


def test_a_csv_export_verifies_and_a_cut_one_does_not(two_runs, tmp_path):
    run = two_runs[0]
    # Cells the export neutralises with a leading ' (and one stored with a leading ' already,
    # which reads the same): the events' hashes tell the readings apart.
    for reason, before in (("=SUM(A1)", -1), ("'=already quoted", {"a": "\r\n"}), ("\tcmd", "@x")):
        AuditEvent.objects.create(
            run=run, at=run.updated_at, actor="-olga", action="note", reason=reason, before=before
        )
    path = tmp_path / "audit.csv"
    call_command("export_audit", "--format", "csv", "--output", str(path), stdout=StringIO())
    text = path.read_bytes().decode()
    assert "'=SUM(A1)" in text and "''=already quoted" not in text

    code, out, err = verify("--file", str(path))
    assert (code, err) == (0, "") and f"{AuditEvent.objects.count()} events in 2 runs" in out

    rows = text.split("\r\n")
    last_of_run = max(i for i, row in enumerate(rows) if row.startswith("20") and f",{run.workflow_id}," in row)
    path.write_text("\r\n".join(rows[:last_of_run] + rows[last_of_run + 1 :]), newline="")
    code, _, err = verify("--file", str(path))
    assert code == 1 and f"run {run.workflow_id}: the export holds" in err

    edited = text.replace("'=SUM(A1)", "'=SUM(A2)")
    path.write_text(edited, newline="")
    code, _, err = verify("--file", str(path))
    assert code == 1 and "its content does not match its hash" in err
