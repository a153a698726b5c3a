"""The run page's timeline, laid out on the server (recovery/console/timeline.py): each attempt a
bar from its start to its outcome, as long as it took; gap labels stacked so that none overlaps
another; every time on its axis with its zone. (The same in a browser:
tests/browser/test_timeline_and_width_browser.py.)"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import combinations

import pytest

from recovery.console import timeline as tl
from recovery.engine.transitions import run_start
from recovery.models import AuditEvent

T0 = datetime(2026, 12, 3, 14, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def overlap(a: dict, b: dict) -> bool:
    return a["row"] == b["row"] and a["left"] < b["right"] and b["left"] < a["right"]


def test_close_labels_are_stacked_on_rows_and_none_overlaps_another():
    labels = [(300 + 5 * i, f"+{10 + i} min") for i in range(9)] + [(630, "+2 h 13 min"), (178, "+40 min")]
    placed, rows = tl.stack(labels, 170, 640, char_width=tl.CHAR_WIDTH, pad=tl.LABEL_PAD)

    assert [p["text"] for p in placed] == [text for _, text in labels]  # in the order given
    assert rows > 1
    assert not [(a["text"], b["text"]) for a, b in combinations(placed, 2) if overlap(a, b)]
    gaps = [
        b["left"] - a["right"] for a, b in combinations(placed, 2) if a["row"] == b["row"] and a["left"] < b["left"]
    ]
    assert all(g >= tl.LABEL_PAD for g in gaps)
    assert all(170 <= p["left"] and p["right"] <= 640 for p in placed)  # moved inside, not cut off
    assert placed[-1]["x"] > 178 and placed[-2]["x"] < 630  # near an edge: moved in


def test_labels_far_apart_keep_their_place_on_one_row():
    placed, rows = tl.stack([(250, "+3 min"), (400, "+7 min")], 170, 640, char_width=6.5, pad=6)
    assert rows == 1 and [p["x"] for p in placed] == [250, 400] and {p["row"] for p in placed} == {0}


def test_an_attempt_is_its_start_and_the_next_event_of_its_step():
    def e(t, action, step="s"):
        return {"at": at(t), "action": action, "step_name": step}

    events = [
        e(0, "step_begin"),
        e(1, "step_begin", "other"),
        e(3.2, "step_fail"),
        e(5, "step_begin"),  # its outcome was never recorded (a crash): no attempt
        e(9, "step_begin"),
        e(9.5, "step_succeed"),
        e(10, "outbox_delivered"),  # no attempt open: a point
    ]
    pairs = tl.attempts(events)
    assert [(b["at"], o["at"], o["action"]) for b, o in pairs] == [
        (at(0), at(3.2), "step_fail"),
        (at(9), at(9.5), "step_succeed"),
    ]


def test_a_gap_inside_an_attempt_is_never_compressed():
    # One attempt of 1000 s in a run of an hour: without its span it would be a compressed gap.
    times = [at(0), at(1), at(1001), at(3600)]
    squeezed = tl._TimeScale(times, 0, 400)
    kept = tl._TimeScale(times, 0, 400, spans=[(at(1), at(1001))])
    assert kept.x(at(1001)) - kept.x(at(1)) > squeezed.x(at(1001)) - squeezed.x(at(1)) == tl._TimeScale.GAP
    assert [g["label"] for g in kept.gaps()] == ["+43 min"]


@pytest.mark.django_db(databases=["default", "sandbox"])
def test_the_timeline_draws_attempts_as_bars_as_long_as_they_took_with_gap_labels_apart(clock):
    run = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "bars"})[0]
    start = run.created_at
    plan = [(1, 0.5), (3, 1.5), (7, 3.2), (14, 6.0), (14 + 9 * 60, 1.0), (14 + 19 * 60, 2.0), (14 + 60 * 60, 2.5)]
    events = []
    for offset, took in plan:
        began = start + timedelta(seconds=offset)
        events += [
            AuditEvent(run=run, at=began, step_name="create_task", actor="executor", action="step_begin"),
            AuditEvent(
                run=run,
                at=began + timedelta(seconds=took),
                step_name="create_task",
                actor="executor",
                action="step_fail",
            ),
        ]
    AuditEvent.objects.bulk_create(events)

    line = tl.timeline(run, list(run.steps.order_by("position")))

    assert [b["seconds"] for b in line["bars"]] == [took for _, took in plan] and not line["marks"]
    by_length = sorted(line["bars"], key=lambda b: b["seconds"])
    assert [b["width"] for b in by_length] == sorted(b["width"] for b in by_length)
    assert by_length[0]["width"] < by_length[2]["width"] < by_length[-1]["width"]
    assert "attempt of 3.2 s, then step_fail" in line["bars"][2]["title"]
    assert [e["took"] for e in line["events"] if e["what"] == "create_task: step_fail"][2] == "3.2 s"

    labels = [g["label"] for g in line["gaps"]]
    assert labels == ["+9 min", "+10 min", "+41 min"]
    boxes = [
        {
            "row": (g["label_y"] - line["gaps"][0]["label_y"]) // tl.ROW_HEIGHT,
            "left": g["label_x"] - w / 2,
            "right": g["label_x"] + w / 2,
        }
        for g in line["gaps"]
        for w in [len(g["label"]) * tl.CHAR_WIDTH]
    ]
    assert not [pair for pair in combinations(boxes, 2) if overlap(*pair)]
    assert max(g["label_y"] for g in line["gaps"]) < line["height"]  # inside the drawing
    assert line["ticks"] and all(t["label"].endswith(" UTC") for t in line["ticks"])
    assert [t["anchor"] for t in line["ticks"]][0] == "start"
