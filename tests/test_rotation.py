"""The crash cases' rotation (tests.support.rotation): a day's two passes take disjoint shares,
two days take every case, and each share holds every row and every kind of boundary."""

from __future__ import annotations

import pytest

from recovery.engine import failpoints
from tests.support import rotation

ROWS = [f"row{i}" for i in range(7)]
CASES = [(row, point) for row in ROWS for point in failpoints.POINTS]


def test_a_day_s_two_passes_are_disjoint_and_two_days_take_every_case():
    day = 739954
    passes = [rotation.chosen(CASES, vendor, seed) for seed in (day, day + 1) for vendor in ("postgresql", "sqlite")]
    assert not set(passes[0]) & set(passes[1])
    assert sorted(case for taken in passes for case in taken) == sorted(CASES)


def test_a_share_holds_every_row_and_every_kind_of_boundary():
    for seed in range(rotation.SHARES):
        taken = rotation.chosen(CASES, "postgresql", seed)
        assert sorted(row for row, _ in taken) == ROWS
        assert {point for _, point in taken} == set(failpoints.POINTS)


def test_all_takes_every_case_and_the_header_names_the_seed(monkeypatch):
    monkeypatch.setenv(rotation.VARIABLE, "all")
    assert rotation.chosen(CASES, "sqlite", rotation.seed()) == CASES
    monkeypatch.setenv(rotation.VARIABLE, "5")
    header = rotation.header("crash", CASES, "postgresql")
    assert header.startswith("crash: seed 5 (RECOVERY_CRASH_ROTATION), share 1 of 4 on postgresql, 7 of 28 cases: ")
    monkeypatch.setenv(rotation.VARIABLE, "soon")
    with pytest.raises(ValueError):
        rotation.seed()
