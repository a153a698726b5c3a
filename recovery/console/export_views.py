"""The audit trail download (docs/recovery-contract.md auditors): ``GET /audit/export?format=csv|jsonl&run=…&since=…
&until=…&workflow=…&actor=…&action=…``, streamed. The rules live in ``recovery.engine.audit.export``."""

from django.contrib.auth.views import redirect_to_login
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpResponse, StreamingHttpResponse
from django.views.decorators.cache import never_cache

from recovery.console.views import require_GET
from recovery.engine.audit import export as exports
from recovery.permissions import can


@require_GET
@never_cache
def export_audit(request):
    if not request.user.is_authenticated:
        return redirect_to_login(request.get_full_path())
    if not can(request.user, "export"):
        return _plain("You may not export the audit trail.", status=403)
    try:
        filters = exports.parse_filters(request.GET)
    except ValueError as exc:
        return _plain(str(exc), status=400)
    # An ASGI server needs an asynchronous iterator to stream (a synchronous one is read whole).
    chunks = exports.aexport_chunks(filters) if isinstance(request, ASGIRequest) else exports.export_chunks(filters)
    response = StreamingHttpResponse(chunks, content_type=exports.FORMATS[filters.format].content_type)
    response["Content-Disposition"] = f'attachment; filename="{exports.export_filename(filters)}"'
    return response


def _plain(message: str, *, status: int) -> HttpResponse:
    return HttpResponse(message + "\n", status=status, content_type="text/plain; charset=utf-8")
