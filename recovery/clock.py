"""The engine's only source of time, so that tests can move it."""

from datetime import datetime

from django.utils import timezone


def now() -> datetime:
    return timezone.now()
