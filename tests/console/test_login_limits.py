"""Login limits beside the per-user lock (issue 34, item 3): one client address that fails across
many usernames is refused (RECOVERY_LOGIN_MAX_FAILURES_PER_ADDRESS), failures across the whole
console in a short window slow a spray from many addresses (RECOVERY_LOGIN_MAX_FAILURES_GLOBAL)
and refuse an operator for at most that window; the address is REMOTE_ADDR unless a proxy header
is configured; a 429 names the limit and never whether the username exists; and the per-user
check is atomic: a parallel burst of wrong guesses checks no more passwords than the limit."""

from __future__ import annotations

import re
import threading

import pytest
from django.conf import settings
from django.contrib.auth import authenticate, get_user_model
from django.db import connection
from django.test import Client

from recovery.models import LoginFailure

PASSWORD = "correct horse battery"


@pytest.fixture
def alice(db):
    return get_user_model().objects.create_user("alice", password=PASSWORD)


def log_in(username: str, password: str, address: str = "203.0.113.7", url: str = "/login/", **headers):
    return Client(REMOTE_ADDR=address, **headers).post(url, {"username": username, "password": password})


def flash(response) -> str:
    found = re.search(r'<p class="flash error"[^>]*>(.*?)</p>', response.text, flags=re.S)
    return found.group(1).strip() if found else ""


def spray(count: int, address: str = "203.0.113.7", **headers) -> list[int]:
    return [log_in(f"user{i}", "Summer2026!", address, **headers).status_code for i in range(count)]


@pytest.mark.django_db
def test_one_address_spraying_many_usernames_is_refused_even_the_right_password(alice, clock):
    assert settings.RECOVERY_LOGIN_MAX_FAILURES_PER_ADDRESS == 20
    assert spray(19) == [200] * 19  # one failure per username: the per-user lock never trips
    twentieth = log_in("user19", "Summer2026!")
    assert twentieth.status_code == 429 and flash(twentieth).startswith("Too many failed logins from your address.")
    refused = log_in("alice", PASSWORD)
    assert refused.status_code == 429 and "_auth_user_id" not in refused.client.session
    assert int(refused["Retry-After"]) == settings.RECOVERY_LOGIN_LOCKOUT_SECONDS
    assert LoginFailure.objects.count() == 20  # refused attempts are not counted
    assert log_in("alice", PASSWORD, address="198.51.100.9").status_code == 302  # another address is not affected
    clock.advance(settings.RECOVERY_LOGIN_LOCKOUT_SECONDS + 1)
    assert log_in("alice", PASSWORD).status_code == 302


@pytest.mark.django_db
def test_a_forwarded_for_header_is_not_trusted_by_default(alice, clock):
    for i in range(20):
        log_in(f"user{i}", "Summer2026!", HTTP_X_FORWARDED_FOR=f"10.0.0.{i}")
    assert log_in("alice", PASSWORD, HTTP_X_FORWARDED_FOR="10.9.9.9").status_code == 429


@pytest.mark.django_db
def test_behind_a_trusted_proxy_the_address_is_the_one_it_appended(alice, clock, settings):
    settings.RECOVERY_TRUSTED_PROXY_HEADER = "HTTP_X_FORWARDED_FOR"
    proxy = "192.0.2.1"  # every request comes from the proxy
    for i in range(20):  # what the client wrote itself (left) changes; what the proxy appended does not
        log_in(f"user{i}", "Summer2026!", proxy, HTTP_X_FORWARDED_FOR=f"10.0.0.{i}, 203.0.113.7")
    assert log_in("alice", PASSWORD, proxy, HTTP_X_FORWARDED_FOR="203.0.113.7").status_code == 429
    assert log_in("alice", PASSWORD, proxy, HTTP_X_FORWARDED_FOR="203.0.113.7, 198.51.100.9").status_code == 302
    assert set(LoginFailure.objects.values_list("address", flat=True)) == {"203.0.113.7"}


@pytest.mark.django_db
def test_a_spray_from_many_addresses_meets_the_global_ceiling_which_opens_within_its_window(alice, clock, settings):
    settings.RECOVERY_LOGIN_MAX_FAILURES_GLOBAL = 30
    assert settings.RECOVERY_LOGIN_GLOBAL_WINDOW_SECONDS == 60
    codes = [log_in(f"user{i}", "Summer2026!", f"10.0.{i // 4}.{i % 4 + 1}").status_code for i in range(30)]
    assert codes == [200] * 29 + [429]  # no address, no username near its own limit
    refused = log_in("alice", PASSWORD, "198.51.100.9")
    assert refused.status_code == 429 and flash(refused).startswith("Too many failed logins on this console")
    assert 0 < int(refused["Retry-After"]) <= 60
    assert LoginFailure.objects.count() == 30
    clock.advance(61)  # the ceiling opens after its short window, not the 15-minute lockout
    assert log_in("alice", PASSWORD, "198.51.100.9").status_code == 302


@pytest.mark.django_db
def test_a_refusal_says_the_same_for_a_username_that_exists_and_one_that_does_not(alice, clock):
    for name in ("alice", "nobody"):
        for _ in range(5):
            log_in(name, "wrong", address="198.51.100.9")
    exists, missing = log_in("alice", PASSWORD), log_in("nobody", PASSWORD)
    assert exists.status_code == missing.status_code == 429
    assert flash(exists) == flash(missing) == "Too many failed logins for this user. Try again in 15 minutes."
    assert exists["Retry-After"] == missing["Retry-After"]


@pytest.mark.django_db
def test_the_admin_login_counts_against_the_address_limit_too(clock):
    get_user_model().objects.create_superuser("root", password=PASSWORD)
    spray(20)
    refused = Client(REMOTE_ADDR="203.0.113.7")
    refused.post("/admin/login/", {"username": "root", "password": PASSWORD})
    assert "_auth_user_id" not in refused.session
    elsewhere = Client(REMOTE_ADDR="198.51.100.9")
    elsewhere.post("/admin/login/", {"username": "root", "password": PASSWORD})
    assert "_auth_user_id" in elsewhere.session


@pytest.mark.django_db(transaction=True)
def test_a_parallel_burst_of_wrong_guesses_checks_no_more_passwords_than_the_limit(postgres_only, alice):
    """The per-user check and the count are one step under a lock per username: with 16
    guesses in flight at once, at most RECOVERY_LOGIN_MAX_FAILURES of them are counted (each
    counted one is one password checked); the rest are refused unchecked."""
    burst = 16
    barrier = threading.Barrier(burst)
    results: list[object] = []

    def guess(n: int) -> None:
        try:
            barrier.wait()
            results.append(authenticate(None, username="alice", password=f"guess-{n}"))
        finally:
            connection.close()

    threads = [threading.Thread(target=guess, args=(n,)) for n in range(burst)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [None] * burst
    assert LoginFailure.objects.filter(username="alice").count() == settings.RECOVERY_LOGIN_MAX_FAILURES
