"""``/metrics`` for a scraper with the token, ``/healthz`` and ``/readyz`` for anyone: no
login, no session, nothing secret in them."""

from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe

from recovery.observability import exposition, health

_TEXT = "text/plain; charset=utf-8"


@never_cache
@require_safe
def metrics(request: HttpRequest) -> HttpResponse:
    expected = settings.RECOVERY_METRICS_TOKEN
    if not expected:
        return HttpResponse("metrics are off: set RECOVERY_METRICS_TOKEN\n", status=404, content_type=_TEXT)
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not presented:
        response = HttpResponse(
            "metrics need Authorization: Bearer <RECOVERY_METRICS_TOKEN>\n", status=401, content_type=_TEXT
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        return HttpResponse("wrong metrics token\n", status=403, content_type=_TEXT)
    return HttpResponse(exposition.render(), content_type=exposition.CONTENT_TYPE)


@never_cache
@require_safe
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse(health.live())


@never_cache
@require_safe
def readyz(request: HttpRequest) -> JsonResponse:
    report = health.ready()
    return JsonResponse(report, status=200 if report["status"] == "ok" else 503)
