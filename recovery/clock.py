"""The engine's only source of time, so that tests (and the demo's seed) can move it."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime

from django.utils import timezone

_source: Callable[[], datetime] | None = None


def now() -> datetime:
    return _source() if _source is not None else timezone.now()


@contextmanager
def driven_by(source: Callable[[], datetime]) -> Iterator[None]:
    """Within the block, the engine's time is ``source()``: a demo replays runs at past times."""
    global _source
    previous, _source = _source, source
    try:
        yield
    finally:
        _source = previous


def time_of_day(when: datetime) -> str:
    """A time of day in the console's zone (settings.TIME_ZONE), with that zone: "12:03:04 UTC".
    What people read (pages, sentences, ``show_run``); machine outputs keep ISO 8601."""
    return f"{timezone.localtime(when):%H:%M:%S %Z}"
