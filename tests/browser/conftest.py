"""Browser tests drive Debian's Chromium with Playwright (its own browser download does not work
here): one browser per test module, launched headless with the flags below. A logged-in page of
a role (``page_as``) and the screenshots kept under var/screenshots/ (``shot``) are shared by the
test modules."""

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

SHOTS = Path(__file__).resolve().parents[2] / "var" / "screenshots"

needs_chromium = pytest.mark.skipif(
    not shutil.which(CHROMIUM), reason="needs Debian's chromium (apt-get install -y chromium)"
)

# The browser tests of what the page itself does (markup, scripts, the policy, layout, focus),
# whose data the engine's other tests read back on both storage engines, are marked
# storage_agnostic (tests/conftest.py): CI's SQLite pass deselects them. `make test` runs them.


@pytest.fixture(scope="module", autouse=True)
def _allow_orm_beside_playwright():
    # Playwright's sync API runs an event loop in this thread; the test's own ORM calls are
    # ordinary synchronous code all the same.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    yield
    os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page_as(browser, live_server):
    """``page_as(role)``: a new browser context logged in through the login form as a new user
    of that role (a group of that name), on the runs list. ``username`` names the user (default:
    the role), for a second person of the same role; other keywords go to ``new_context``."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    pages = []

    def open_as(role: str, *, username: str | None = None, **context_options):
        username = username or role
        user = get_user_model().objects.create_user(username, password=f"{username}-pw")
        user.groups.add(Group.objects.get_or_create(name=role)[0])
        options = {"viewport": {"width": 1360, "height": 900}, "accept_downloads": True, **context_options}
        context = browser.new_context(**options)
        page = context.new_page()
        page.goto(f"{live_server.url}/login/")
        page.fill("input[name=username]", username)
        page.fill("input[name=password]", f"{username}-pw")
        page.click("button[type=submit]")
        page.wait_for_url(f"{live_server.url}/")
        pages.append(context)
        return page

    yield open_as
    for context in pages:
        context.close()


def shot(page, name: str) -> None:
    """A full-page screenshot, var/screenshots/NAME.png (kept by CI as an artefact)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
