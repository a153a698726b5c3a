"""Console accounts (issue 34, items 3 and 4): every password a person sets passes Django's
validators; users and groups are read-only in the admin, even for a superuser; every change to
an account (created, role from → to, password changed, activated) is an append-only
AccountEvent naming who made it and why, and nothing is recorded when nothing changed."""

from __future__ import annotations

from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.contrib.auth.password_validation import validate_password
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction
from django.test import Client

from recovery import accounts
from recovery.models import AccountEvent

pytestmark = pytest.mark.django_db

GOOD = "correct horse battery"


def createoperator(*args: str) -> str:
    out = StringIO()
    call_command("createoperator", *args, stdout=out, stderr=StringIO())
    return out.getvalue().strip()


def events() -> list[tuple[str, str, str, str, str, str]]:
    return list(AccountEvent.objects.values_list("actor", "via", "username", "action", "before", "after"))


@pytest.mark.parametrize(
    "username,password,why",
    [
        ("olga", "1", "too short"),
        ("olga", "olga", "too short"),
        ("nightshift-olga", "nightshift-olga", "too similar to the username"),
        ("olga", "password1234", "too common"),
        ("olga", "123456789012345", "entirely numeric"),
        ("olga", "Tr0ub4dor&3", "too short"),  # 11 characters: the minimum is 12
    ],
)
def test_createoperator_refuses_a_weak_password_in_one_line_and_writes_nothing(username, password, why):
    groups = set(Group.objects.values_list("name", flat=True))
    with pytest.raises(CommandError, match=why) as refused:
        createoperator(username, "--group", "supervisor", "--password", password, "--reason", "hired")
    assert "\n" not in str(refused.value) and "nothing was changed" in str(refused.value)
    assert not get_user_model().objects.exists()
    assert set(Group.objects.values_list("name", flat=True)) == groups
    assert not AccountEvent.objects.exists()


def test_a_weak_password_does_not_change_an_existing_user_either():
    createoperator("olga", "--group", "operator", "--password", GOOD, "--reason", "hired")
    with pytest.raises(CommandError, match="too short"):
        createoperator("olga", "--group", "supervisor", "--password", "short", "--reason", "promoted")
    olga = get_user_model().objects.get(username="olga")
    assert olga.check_password(GOOD) and list(olga.groups.values_list("name", flat=True)) == ["operator"]
    assert [e[3] for e in events()] == ["created"]


def test_a_generated_password_passes_the_validators():
    line = createoperator("olga", "--group", "viewer", "--reason", "read-only access for audits")
    password = line.rsplit(" ", 1)[1]
    validate_password(password, user=get_user_model().objects.get(username="olga"))  # raises if weak


@pytest.mark.parametrize("reason", ["", "   ", "x" * 2001, "nul\x00"])
def test_createoperator_needs_a_reason_and_writes_nothing_without_one(reason):
    with pytest.raises(CommandError, match="reason"):
        createoperator("olga", "--group", "viewer", "--password", GOOD, "--reason", reason)
    assert not get_user_model().objects.exists() and not AccountEvent.objects.exists()


def test_createoperator_without_reason_keeps_working_for_scripts_and_says_so(monkeypatch):
    # SPEC §6: `createoperator USER --group G [--password P]`, as runbooks call it.
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert createoperator("olga", "--group", "viewer", "--password", GOOD) == "created 'olga' in group viewer"
    event = AccountEvent.objects.get()
    assert (event.action, event.reason) == ("created", "no reason given (createoperator without --reason)")
    assert event.actor == accounts.os_user()


def test_every_change_is_recorded_with_who_and_why_and_nothing_when_nothing_changed():
    os_user = accounts.os_user()
    createoperator("olga", "--group", "operator", "--password", GOOD, "--reason", "hired for the night shift")
    assert events() == [(os_user, "createoperator", "olga", "created", "", "operator")]
    first = AccountEvent.objects.get()
    assert first.reason == "hired for the night shift" and first.os_user == os_user

    line = createoperator("olga", "--group", "operator", "--password", GOOD, "--reason", "again", "--by", "sam")
    assert line == "'olga' unchanged in group operator"
    assert AccountEvent.objects.count() == 1  # nothing changed, nothing recorded

    createoperator("olga", "--group", "supervisor", "--password", GOOD, "--reason", "ticket 12", "--by", "sam")
    createoperator("olga", "--group", "supervisor", "--password", "a new long passphrase", "--reason", "rotated")
    olga = get_user_model().objects.get(username="olga")
    olga.is_active = False
    olga.save()
    createoperator("olga", "--group", "supervisor", "--password", "a new long passphrase", "--reason", "back")
    assert events()[1:] == [
        ("sam", "createoperator", "olga", "role_changed", "operator", "supervisor"),
        (os_user, "createoperator", "olga", "password_changed", "", ""),
        (os_user, "createoperator", "olga", "activated", "", ""),
    ]
    assert AccountEvent.objects.get(action="role_changed").os_user == os_user  # --by is beside the OS user
    assert "new long" not in " ".join(str(e) for e in AccountEvent.objects.all())  # no password in the record


def test_deactivateoperator_ends_logins_and_sessions_and_is_recorded_once():
    createoperator("olga", "--group", "operator", "--password", GOOD, "--reason", "hired")
    session = Client()
    session.force_login(get_user_model().objects.get(username="olga"))
    assert session.get("/").status_code == 200
    out = StringIO()
    call_command("deactivateoperator", "olga", "--reason", "left the company", "--by", "sam", stdout=out)
    assert out.getvalue().strip() == "deactivated 'olga'"
    assert session.get("/").status_code == 302  # the open session ends at its next request
    assert Client().post("/login/", {"username": "olga", "password": GOOD}).status_code == 200
    call_command("deactivateoperator", "olga", "--reason", "again", stdout=StringIO())
    assert events()[1:] == [("sam", "deactivateoperator", "olga", "deactivated", "operator", "")]
    with pytest.raises(CommandError, match="no user 'nobody'; nothing was changed"):
        call_command("deactivateoperator", "nobody", "--reason", "typo", stdout=StringIO())
    assert AccountEvent.objects.count() == 2


def test_account_events_lists_the_changes_with_control_characters_escaped():
    createoperator("olga", "--group", "operator", "--password", GOOD, "--reason", "hired")
    createoperator("ivan", "--group", "viewer", "--password", GOOD, "--reason", "audit")
    AccountEvent.objects.create(
        at=AccountEvent.objects.last().at, actor="x", via="old row", username="ivan", action="created", reason="\x1b[2J"
    )
    out = StringIO()
    call_command("account_events", "--user", "ivan", stdout=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "created ivan - → viewer: audit" in lines[0]
    assert "\x1b" not in out.getvalue() and "\\x1b[2J" in lines[1]


def test_account_events_cannot_be_changed_or_deleted():
    createoperator("olga", "--group", "operator", "--password", GOOD, "--reason", "hired")
    for attempt in (
        lambda: AccountEvent.objects.update(reason="nothing to see"),
        lambda: AccountEvent.objects.all().delete(),
    ):
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            attempt()
    assert AccountEvent.objects.get().reason == "hired"


def test_account_events_cannot_be_truncated():
    if connection.vendor != "postgresql":
        pytest.skip("SQLite has no TRUNCATE (its DELETE is refused above)")
    createoperator("olga", "--group", "operator", "--password", GOOD, "--reason", "hired")
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {accounts.TABLE}")
    assert AccountEvent.objects.count() == 1


# --- the admin ---------------------------------------------------------------------------------


@pytest.fixture
def root() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", password=GOOD))
    return client


def test_a_superuser_cannot_add_or_change_users_or_groups_in_the_admin(root):
    olga = get_user_model().objects.create_user("olga", password=GOOD)
    assert root.get("/admin/auth/user/add/").status_code == 403
    response = root.post("/admin/auth/user/add/", {"username": "mallory", "password1": GOOD, "password2": GOOD})
    assert response.status_code == 403
    groups = set(Group.objects.values_list("name", flat=True))
    response = root.post(f"/admin/auth/user/{olga.pk}/change/", {"username": "olga", "is_superuser": "on"})
    assert response.status_code == 403
    # Django's UserAdmin has a password form here; the read-only one has none (it redirects to the change page).
    root.post(f"/admin/auth/user/{olga.pk}/password/", {"password1": "x" * 20, "password2": "x" * 20}, follow=True)
    assert root.post("/admin/auth/group/add/", {"name": "night-supervisors"}).status_code == 403
    assert root.post(f"/admin/auth/user/{olga.pk}/delete/", {"post": "yes"}).status_code == 403
    olga.refresh_from_db()
    assert not olga.is_superuser and olga.check_password(GOOD)
    assert sorted(get_user_model().objects.values_list("username", flat=True)) == ["olga", "root"]
    assert set(Group.objects.values_list("name", flat=True)) == groups


def test_the_admin_shows_users_without_their_password_hash_and_lists_the_account_events(root):
    createoperator("olga", "--group", "operator", "--password", GOOD, "--reason", "hired for nights")
    olga = get_user_model().objects.get(username="olga")
    page = root.get(f"/admin/auth/user/{olga.pk}/change/")
    assert page.status_code == 200 and "olga" in page.text
    assert olga.password not in page.text and "md5$" not in page.text
    listing = root.get("/admin/recovery/accountevent/")
    assert listing.status_code == 200 and "hired for nights" in listing.text
    assert root.get("/admin/recovery/accountevent/add/").status_code == 403


# --- the demo's logins -------------------------------------------------------------------------


def test_demo_login_sets_a_password_that_passes_the_validators_and_records_it_once(settings, tmp_path):
    settings.DEBUG = True
    settings.VAR_DIR = tmp_path
    out = StringIO()
    call_command("demo_login", stdout=out)
    password = (tmp_path / "demo-password").read_text().strip()
    assert out.getvalue().strip() == f"demo logins: demo (superuser); password: {password}"
    demo = get_user_model().objects.get(username="demo")
    assert demo.is_superuser and demo.check_password(password) and not demo.check_password("demo")
    validate_password(password, user=demo)
    assert events() == [(accounts.os_user(), "demo_login", "demo", "created", "", "superuser")]
    call_command("demo_login", stdout=StringIO())
    assert AccountEvent.objects.count() == 1  # the same password again: nothing changed


def test_a_second_demo_login_derives_no_key_and_a_password_changed_meanwhile_is_set_back(
    settings, tmp_path, monkeypatch
):
    settings.DEBUG = True
    settings.VAR_DIR = tmp_path
    call_command("demo_login", stdout=StringIO())
    password = (tmp_path / "demo-password").read_text().strip()
    User = get_user_model()
    checked = []
    check = User.check_password
    monkeypatch.setattr(User, "check_password", lambda user, raw: checked.append(raw) or check(user, raw))
    call_command("demo_login", stdout=StringIO())
    assert checked == [] and AccountEvent.objects.count() == 1  # its hash is the one seen matching

    demo = User.objects.get(username="demo")
    demo.set_password("someone changed it meanwhile")
    demo.save()
    call_command("demo_login", stdout=StringIO())
    demo.refresh_from_db()
    assert checked == [password] and demo.check_password(password)
    assert [e[3] for e in events()] == ["created", "password_changed"]
    (tmp_path / "demo-password").write_text("another-demo-password-2026\n")  # a new demo password
    checked.clear()
    call_command("demo_login", stdout=StringIO())
    assert checked == ["another-demo-password-2026"]
    assert (tmp_path / "demo-password.verified").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize(
    "command,args",
    [
        ("createsuperuser", ["--username", "mallory", "--email", "m@example.com", "--noinput"]),
        ("changepassword", ["olga"]),
    ],
)
def test_djangos_unrecorded_account_commands_are_closed(command, args, monkeypatch):
    # A superuser counts as a supervisor; Django's commands set passwords with no AccountEvent.
    createoperator("olga", "--group", "operator", "--password", GOOD, "--reason", "hired")
    before = (list(get_user_model().objects.values_list("username", "password", "is_superuser")), events())
    monkeypatch.setenv("DJANGO_SUPERUSER_PASSWORD", "a long enough passphrase")
    with pytest.raises(CommandError, match="use createoperator"):
        call_command(command, *args, stdout=StringIO(), stderr=StringIO())
    assert (list(get_user_model().objects.values_list("username", "password", "is_superuser")), events()) == before
