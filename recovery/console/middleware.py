"""Input hygiene at the edge of the site, before any view runs."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django_htmx.http import reswap, retarget

NUL = "\x00"
NUL_MESSAGE = "the request contains a NUL character (U+0000), which no field accepts"


class RejectNulCharactersMiddleware:
    """A request with a NUL character in its path, its query string or (for the console's
    forms) its form fields is a 400 with a message, before any view runs.

    PostgreSQL cannot store or even compare text containing U+0000: a NUL reaching a query
    raises an error there (a 500), while SQLite stores it. No operator types one, so none is
    accepted, whatever the database (Django's form fields refuse it the same way). Views that
    are CSRF-exempt (the JSON API, the simulated systems) read their own bodies; their path
    and query string are checked here all the same (the refusal is then JSON, like their
    other errors), and the API checks the parsed JSON itself."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_view(self, request: HttpRequest, view_func, view_args, view_kwargs) -> HttpResponse | None:
        json_endpoint = getattr(view_func, "csrf_exempt", False)
        if NUL in request.path_info or _has_nul(request.GET):
            return _refuse(request, json_endpoint=json_endpoint)
        if request.method == "POST" and not json_endpoint and _has_nul(request.POST):
            return _refuse(request, json_endpoint=False)
        return None


def _has_nul(params) -> bool:
    return any(NUL in key or any(NUL in value for value in values) for key, values in params.lists())


def _refuse(request: HttpRequest, *, json_endpoint: bool) -> HttpResponse:
    if json_endpoint:  # the API and the simulated systems answer errors as {"error": …}
        return JsonResponse({"error": NUL_MESSAGE}, status=400)
    if getattr(request, "htmx", False):
        response = render(request, "console/flash.html", {"message": NUL_MESSAGE, "level": "error"}, status=400)
        return reswap(retarget(response, "#flash"), "innerHTML")
    return HttpResponse(NUL_MESSAGE + "\n", status=400, content_type="text/plain; charset=utf-8")
