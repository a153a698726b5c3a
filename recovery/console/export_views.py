"""The audit trail download (docs/recovery-contract.md auditors): ``GET /audit/export?format=csv|jsonl&run=…&since=…
&until=…&workflow=…&actor=…&action=…``, streamed. The rules live in ``recovery.engine.audit.export``.

A refusal is the console's refusal page for a browser (a client that asks for HTML: the nav's
"Audit CSV" link, a link shared by an operator) and one line of plain text for everything else
(curl, scripts: unchanged)."""

from django.contrib.auth.views import redirect_to_login
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpResponse, StreamingHttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.vary import vary_on_headers

from recovery.engine.audit import export as exports
from recovery.http import flash, require_GET
from recovery.permissions import can


@require_GET
@never_cache
@vary_on_headers("Accept")
def export_audit(request):
    if not request.user.is_authenticated:
        return redirect_to_login(request.get_full_path())
    if not can(request.user, "export"):
        return _refused(request, "You may not export the audit trail.", status=403)
    try:
        filters = exports.parse_filters(request.GET)
    except ValueError as exc:
        return _refused(request, str(exc), status=400)
    # An ASGI server needs an asynchronous iterator to stream (a synchronous one is read whole).
    chunks = exports.aexport_chunks(filters) if isinstance(request, ASGIRequest) else exports.export_chunks(filters)
    response = StreamingHttpResponse(chunks, content_type=exports.FORMATS[filters.format].content_type)
    response["Content-Disposition"] = f'attachment; filename="{exports.export_filename(filters)}"'
    return response


def _refused(request, message: str, *, status: int) -> HttpResponse:
    if not _wants_html(request):
        return HttpResponse(message + "\n", status=status, content_type="text/plain; charset=utf-8")
    if status == 400 and message.startswith("no run "):
        status = 404  # the page says "Not found"; a script keeps its 400
    return flash(request, f"The audit trail was not exported: {message}", status=status)


def _wants_html(request) -> bool:
    """A browser: it asks for text/html before (or without) JSON and plain text."""
    if request.htmx:
        return True
    accept = request.headers.get("Accept", "")
    return "text/html" in accept and "application/json" not in accept.split(",")[0]
