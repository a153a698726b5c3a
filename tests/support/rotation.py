"""A seeded rotation of the real-process crash cases (issue 36): every boundary of the dispute
agent killed in a real worker is a case (28 of them, three process starts each); the in-process
fault matrix sweeps every one of them at every run, so CI runs a quarter of the real-process ones
in each of its two passes, a different quarter each day: every case runs within two days.

    RECOVERY_CRASH_ROTATION=all     every case (what a change to the crash path should run)
    RECOVERY_CRASH_ROTATION=7       the share of seed 7 (a failure's header names its seed)
    (unset)                         the seed of the day: days since 0001-01-01, UTC

The PostgreSQL pass runs share ``seed % 4``; the SQLite pass share ``(seed + 2) % 4``, so one day
covers half the cases and the next day the other half. pytest's header says which ran."""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime

SHARES = 4
VARIABLE = "RECOVERY_CRASH_ROTATION"


def seed() -> int | None:
    """This run's seed, or None: every case."""
    raw = os.environ.get(VARIABLE, "").strip()
    if raw == "all":
        return None
    if raw:
        return int(raw)
    return datetime.now(UTC).date().toordinal()


def share(vendor: str, chosen_seed: int | None) -> int | None:
    if chosen_seed is None:
        return None
    return (chosen_seed + (2 if vendor == "sqlite" else 0)) % SHARES


def chosen[T](cases: Sequence[T], vendor: str, chosen_seed: int | None = None) -> list[T]:
    """The cases this run takes: case ``i`` is in share ``(i + i // SHARES) % SHARES``, so that
    with rows × four boundaries a share holds every row and every kind of boundary once each."""
    taken = share(vendor, chosen_seed)
    return [case for i, case in enumerate(cases) if taken is None or (i + i // SHARES) % SHARES == taken]


def header(name: str, cases: Sequence[object], vendor: str) -> str:
    s = seed()
    ran = chosen(cases, vendor, s)
    if s is None:
        return f"{name}: every case ({len(ran)}; {VARIABLE}=all)"
    listed = ", ".join("-".join(case) if isinstance(case, tuple) else str(case) for case in ran)  # as pytest's ids
    return (
        f"{name}: seed {s} ({VARIABLE}), share {share(vendor, s)} of {SHARES} on {vendor}, "
        f"{len(ran)} of {len(cases)} cases: {listed}"
    )
