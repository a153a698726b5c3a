"""Template context for every page: whether the demo is on (``RECOVERY_DEMO``), so that the
console links the Demo page only where it answers."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest


def demo(request: HttpRequest) -> dict[str, bool]:
    return {"demo_enabled": settings.RECOVERY_DEMO}
