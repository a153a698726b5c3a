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
