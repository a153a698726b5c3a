"""Log in and log out. Login is throttled (recovery.console.login_throttle): a login refused by a
limit gets the form back with 429, which limit it was (this user, this address, or the whole
console) and when to try again. Both answer only the methods they use."""

from __future__ import annotations

import math

from django.contrib.auth import views as auth_views
from django.http import HttpResponse

from recovery import clock
from recovery.console import login_throttle

# The same words for a username that exists and one that does not: a limit says nothing about it.
MESSAGES = {
    "user": "Too many failed logins for this user.",
    "address": "Too many failed logins from your address.",
    "global": "Too many failed logins on this console right now.",
}


class LoginView(auth_views.LoginView):
    # Django's form views also take PUT as a POST: a login is a POST.
    http_method_names = ["get", "head", "post"]

    def form_invalid(self, form) -> HttpResponse:
        refused = getattr(self.request, login_throttle.REFUSAL_ATTRIBUTE, None)
        username = form.data.get("username", "")
        if refused is None and username:  # this failure may have been the last one a limit allows
            refused = login_throttle.refusal(username, login_throttle.client_address(self.request))
        if refused is None:
            return super().form_invalid(form)
        seconds = max(1, math.ceil((refused.until - clock.now()).total_seconds()))
        wait = f"{seconds} second" if seconds < 60 else f"{math.ceil(seconds / 60)} minute"
        wait += "" if wait.startswith("1 ") else "s"
        response = self.render_to_response(
            self.get_context_data(form=form, locked_out=f"{MESSAGES[refused.limit]} Try again in {wait}."),
            status=429,
        )
        response["Retry-After"] = str(seconds)
        return response


class LogoutView(auth_views.LogoutView):
    http_method_names = ["post"]
