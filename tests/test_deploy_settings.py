"""Production settings (issue 7): with DJANGO_DEBUG=0 the settings pass Django's deployment
checks with no warning (cookies over HTTPS only, HSTS, HTTPS redirect, …), and the CSRF cookie
can be HttpOnly because the pages carry the token themselves."""

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.test import Client

ROOT = Path(__file__).resolve().parent.parent


def production_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "SANDBOX_API_KEY", "RECOVERY_"))}
    env.update(
        DJANGO_SETTINGS_MODULE="config.settings",
        DJANGO_DEBUG="0",
        DJANGO_SECRET_KEY=secrets.token_urlsafe(64),
        DJANGO_ALLOWED_HOSTS="console.example.com",
    )
    env.update(extra)
    return env


def manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def production_settings(**extra: str) -> dict:
    names = [
        "SESSION_COOKIE_SECURE",
        "CSRF_COOKIE_SECURE",
        "SESSION_COOKIE_HTTPONLY",
        "CSRF_COOKIE_HTTPONLY",
        "SESSION_COOKIE_SAMESITE",
        "SECURE_SSL_REDIRECT",
        "SECURE_HSTS_SECONDS",
        "SECURE_HSTS_INCLUDE_SUBDOMAINS",
        "SECURE_HSTS_PRELOAD",
        "SECURE_PROXY_SSL_HEADER",
        "SECURE_CONTENT_TYPE_NOSNIFF",
        "X_FRAME_OPTIONS",
        "SECURE_REFERRER_POLICY",
        "SESSION_COOKIE_AGE",
        "SANDBOX_API_KEY",
    ]
    code = (
        "import json; from django.conf import settings; "
        f"print(json.dumps({{n: getattr(settings, n, None) for n in {names!r}}}))"
    )
    result = manage("shell", "-c", code, env=production_env(**extra))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_check_deploy_passes_without_a_warning_in_production():
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=production_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout
    assert "WARNING" not in result.stdout + result.stderr and "?: (security." not in result.stdout + result.stderr


def test_check_deploy_fails_on_the_development_defaults():
    """The check is not vacuous: the embedded defaults (DEBUG on, no TLS) are refused."""
    env = production_env(DJANGO_DEBUG="1")
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=env)
    assert result.returncode != 0 and "security.W018" in result.stdout + result.stderr


def test_production_settings_send_cookies_over_https_only_and_ask_for_hsts():
    values = production_settings()
    assert values == {
        "SESSION_COOKIE_SECURE": True,
        "CSRF_COOKIE_SECURE": True,
        "SESSION_COOKIE_HTTPONLY": True,
        "CSRF_COOKIE_HTTPONLY": True,
        "SESSION_COOKIE_SAMESITE": "Lax",
        "SECURE_SSL_REDIRECT": True,
        "SECURE_HSTS_SECONDS": 31536000,
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": True,
        "SECURE_HSTS_PRELOAD": True,
        "SECURE_PROXY_SSL_HEADER": None,
        "SECURE_CONTENT_TYPE_NOSNIFF": True,
        "X_FRAME_OPTIONS": "DENY",
        "SECURE_REFERRER_POLICY": "same-origin",
        "SESSION_COOKIE_AGE": 8 * 3600,
        "SANDBOX_API_KEY": "",  # the simulated systems are closed unless a key is set
    }


def test_the_proxy_header_hsts_and_redirect_come_from_the_environment():
    values = production_settings(
        DJANGO_SECURE_PROXY_SSL_HEADER="HTTP_X_FORWARDED_PROTO,https",
        DJANGO_SECURE_HSTS_SECONDS="3600",
        DJANGO_SECURE_HSTS_PRELOAD="0",
        DJANGO_SECURE_SSL_REDIRECT="0",
    )
    assert values["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]
    assert (values["SECURE_HSTS_SECONDS"], values["SECURE_HSTS_PRELOAD"], values["SECURE_SSL_REDIRECT"]) == (
        3600,
        False,
        False,
    )


def test_a_malformed_proxy_header_stops_start_up():
    result = manage("check", env=production_env(DJANGO_SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto"))
    assert result.returncode != 0 and "DJANGO_SECURE_PROXY_SSL_HEADER" in result.stderr


@pytest.mark.django_db
def test_pages_carry_the_csrf_token_so_the_cookie_can_be_httponly():
    """htmx reads the token from <body hx-headers>, forms from their hidden field; no script
    reads the cookie, which is HttpOnly."""
    user = get_user_model().objects.create_user("v", password="pw")
    user.groups.add(Group.objects.get_or_create(name="viewer")[0])
    client = Client()
    client.force_login(user)
    page = client.get("/")
    header = re.search(r"hx-headers='\{\"X-CSRFToken\": \"([^\"]+)\"\}'", page.text)
    assert header and len(header.group(1)) >= 32
    assert page.cookies["csrftoken"]["httponly"] is True
    login = Client().get("/login/")
    assert 'name="csrfmiddlewaretoken"' in login.text and login.cookies["csrftoken"]["httponly"] is True
