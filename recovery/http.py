"""What every page of ours checks before its view runs, and how it refuses: the method (a 405
that says which to use), then the session and the role (docs/security.md "Who may do what"), and
a refusal as the console shows it (into the page's ``#flash`` area for htmx, else a page of the
console's layout with a way back). Below the console and the demo pages, which both use it."""

from __future__ import annotations

from functools import wraps

from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django_htmx.http import reswap, retarget

from recovery.permissions import REQUIRED_ROLE, can, role_of


def require_methods(*methods: str):
    """Like Django's ``require_http_methods``, with a message in the 405 (every refusal of the
    console says why)."""

    def decorate(view):
        @wraps(view)
        def wrapper(request: HttpRequest, *args, **kwargs):
            if request.method not in methods:
                return HttpResponseNotAllowed(
                    methods,
                    f"{request.method} is not allowed here; use {' or '.join(methods)}\n",
                    content_type="text/plain; charset=utf-8",
                )
            return view(request, *args, **kwargs)

        return wrapper

    return decorate


require_GET = require_methods("GET")
require_safe = require_methods("GET", "HEAD")
require_POST = require_methods("POST")


def permission_required(action: str):
    """Login first (a page redirects to the login form); then the role, checked on the server.
    Views put the method check outside this one: a wrong method is 405 for everyone (docs/security.md
    "Who may do what": method, then session, then role; a refusal changes nothing)."""

    def decorate(view):
        @wraps(view)
        def wrapper(request: HttpRequest, *args, **kwargs):
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path())
            if not can(request.user, action):
                return flash(request, not_allowed(request, action, "here"), status=403)
            return view(request, *args, **kwargs)

        return wrapper

    return decorate


def not_allowed(request: HttpRequest, action: str, where: str) -> str:
    role = role_of(request.user).name.lower()
    needed = REQUIRED_ROLE[action].name.lower()
    return f"Your role ({role}) may not {action} {where}: that needs the {needed} role."


def flash(request: HttpRequest, message: str, *, status: int, level: str = "error") -> HttpResponse:
    """A refusal: into the page's #flash area for htmx, else a page of the console's layout
    with the message and a way back (never a bare fragment)."""
    if request.htmx:
        response = render(request, "console/flash.html", {"message": message, "level": level}, status=status)
        return reswap(retarget(response, "#flash"), "innerHTML")
    back = request.headers.get("Referer", "")
    if not back or not url_has_allowed_host_and_scheme(back, allowed_hosts={request.get_host()}):
        back = reverse("console:runs")
    context = {"message": message, "level": level, "back": back, "status": status}
    return render(request, "console/refusal.html", context, status=status)
