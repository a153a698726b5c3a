"""Login throttling (issue 7, access control): after RECOVERY_LOGIN_MAX_FAILURES failed logins for a
username within RECOVERY_LOGIN_LOCKOUT_SECONDS, even the right password is refused (429) until the
cool-down ends; a success clears the count; other users are not affected. The failures live in
the database, so every web process counts the same ones."""

from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client

from recovery.console import login_throttle
from recovery.models import LoginFailure

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice():
    return get_user_model().objects.create_user("alice", password="right")


def log_in(client: Client, username: str, password: str, url: str = "/login/"):
    return client.post(url, {"username": username, "password": password})


def logged_in(client: Client) -> bool:
    return "_auth_user_id" in client.session


def fail(client: Client, username: str = "alice", times: int = 1) -> list[int]:
    return [log_in(client, username, "wrong").status_code for _ in range(times)]


def test_the_fifth_failure_locks_the_user_out_and_the_right_password_is_refused(alice, clock):
    client = Client()
    assert settings.RECOVERY_LOGIN_MAX_FAILURES == 5
    assert fail(client, times=4) == [200] * 4
    fifth = log_in(client, "alice", "wrong")
    assert fifth.status_code == 429 and "Too many failed logins" in fifth.text
    right = log_in(client, "alice", "right")
    assert right.status_code == 429 and "Try again in 15 minutes" in right.text
    assert int(right["Retry-After"]) == settings.RECOVERY_LOGIN_LOCKOUT_SECONDS  # the clock stood still
    assert not logged_in(client)
    assert LoginFailure.objects.count() == 5  # attempts while locked are not counted


def test_the_lockout_ends_after_the_cool_down(alice, clock):
    client = Client()
    fail(client, times=5)
    clock.advance(settings.RECOVERY_LOGIN_LOCKOUT_SECONDS - 1)
    assert log_in(client, "alice", "right").status_code == 429
    assert not logged_in(client)
    clock.advance(2)
    response = log_in(client, "alice", "right")
    assert response.status_code == 302 and logged_in(client)
    assert LoginFailure.objects.count() == 0


def test_a_success_clears_the_count(alice, clock):
    client = Client()
    fail(client, times=4)
    assert log_in(client, "alice", "right").status_code == 302
    client.post("/logout/")
    assert fail(client, times=4) == [200] * 4  # four more are allowed again, not one
    assert log_in(client, "alice", "right").status_code == 302


def test_another_user_is_not_affected(alice, clock):
    get_user_model().objects.create_user("bob", password="bobs")
    fail(Client(), times=5)
    bob = Client()
    assert log_in(bob, "bob", "bobs").status_code == 302 and logged_in(bob)
    assert log_in(Client(), "alice", "right").status_code == 429


def test_case_and_spaces_do_not_buy_more_attempts(alice, clock):
    client = Client()
    for name in ("alice", "Alice", "ALICE", " alice", "alicE"):
        log_in(client, name, "wrong")
    assert log_in(client, "alice", "right").status_code == 429


def test_failures_recorded_by_another_process_count(alice, clock):
    """What one web process wrote (rows in the database), another one reads."""
    for _ in range(settings.RECOVERY_LOGIN_MAX_FAILURES):
        LoginFailure.objects.create(username="alice", at=clock.now())
    assert log_in(Client(), "alice", "right").status_code == 429


def test_the_admin_login_is_throttled_too(clock):
    get_user_model().objects.create_superuser("root", password="right")
    client = Client()
    for _ in range(5):
        log_in(client, "root", "wrong", url="/admin/login/")
    log_in(client, "root", "right", url="/admin/login/")
    assert not logged_in(client)
    assert client.get("/admin/").status_code == 302


def test_the_limits_come_from_the_settings(alice, clock, settings):
    settings.RECOVERY_LOGIN_MAX_FAILURES = 2
    settings.RECOVERY_LOGIN_LOCKOUT_SECONDS = 60
    client = Client()
    assert fail(client, times=2) == [200, 429]
    right = log_in(client, "alice", "right")
    assert right.status_code == 429 and "Try again in 1 minute." in right.text
    clock.advance(61)
    assert log_in(client, "alice", "right").status_code == 302


def test_old_failures_are_forgotten(clock):
    login_throttle.record_failure("mallory")
    clock.advance(settings.RECOVERY_LOGIN_LOCKOUT_SECONDS + 1)
    login_throttle.record_failure("eve")
    assert list(LoginFailure.objects.values_list("username", flat=True)) == ["eve"]
    assert LoginFailure.objects.get().at == clock.now()
    assert login_throttle.locked_until("eve") is None


def test_the_lock_opens_when_the_oldest_of_the_failures_leaves_the_window(alice, clock):
    started = clock.now()
    for _ in range(5):
        login_throttle.record_failure("alice")
        clock.advance(10)
    assert login_throttle.locked_until("alice") == started + timedelta(seconds=settings.RECOVERY_LOGIN_LOCKOUT_SECONDS)
