"""Log in and log out. Login is throttled (recovery.console.login_throttle): a locked-out username gets
the form back with 429 and when to try again. Both answer only the methods they use."""

from __future__ import annotations

import math

from django.contrib.auth import views as auth_views
from django.http import HttpResponse

from recovery import clock
from recovery.console import login_throttle


class LoginView(auth_views.LoginView):
    # Django's form views also take PUT as a POST: a login is a POST.
    http_method_names = ["get", "head", "post"]

    def form_invalid(self, form) -> HttpResponse:
        username = form.data.get("username", "")
        until = login_throttle.locked_until(username) if username else None
        if until is None:
            return super().form_invalid(form)
        seconds = max(1, math.ceil((until - clock.now()).total_seconds()))
        minutes = math.ceil(seconds / 60)
        response = self.render_to_response(
            self.get_context_data(
                form=form,
                locked_out=f"Too many failed logins for this user. Try again in {minutes} minute"
                + ("" if minutes == 1 else "s")
                + ".",
            ),
            status=429,
        )
        response["Retry-After"] = str(seconds)
        return response


class LogoutView(auth_views.LogoutView):
    http_method_names = ["post"]
