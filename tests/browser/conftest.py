"""Browser tests drive Debian's Chromium with Playwright (its own browser download does not work
here): one browser per test module, launched headless with the flags below. A logged-in page of
a role (``page_as``) and the screenshots kept under var/screenshots/ (``shot``) are shared by the
test modules."""

import os
import shutil
import threading
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
def new_context(browser, live_server):
    """``new_context(**options)``: a browser context closed when the test ends, and closed before
    the test's database is flushed: teardown then waits for the requests the live server is still
    answering. A page's poll answered while the flush truncates the tables can deadlock with it
    (a reader holds one table and waits for another the flush holds), the flush fails, and the
    next test starts on this one's rows."""
    contexts = []

    def open_context(**options):
        context = browser.new_context(**options)
        contexts.append(context)
        return context

    yield open_context
    for context in contexts:
        context.close()
    _wait_for_requests_in_flight(live_server)


def _wait_for_requests_in_flight(live_server, timeout: float = 120) -> None:
    # socketserver.ThreadingMixIn answers each connection in a thread whose target is the
    # server's process_request_thread (daemon threads, so the server keeps no list of them).
    # No context is open any more, so no new request comes; join those still being answered.
    httpd = live_server.thread.httpd
    for thread in threading.enumerate():
        if getattr(getattr(thread, "_target", None), "__self__", None) is httpd:
            thread.join(timeout)


@pytest.fixture
def page_as(new_context, live_server):
    """``page_as(role)``: a new browser context logged in through the login form as a new user
    of that role (a group of that name), on the runs list. ``username`` names the user (default:
    the role), for a second person of the same role; other keywords go to ``new_context``."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    def open_as(role: str, *, username: str | None = None, **context_options):
        username = username or role
        user = get_user_model().objects.create_user(username, password=f"{username}-pw")
        user.groups.add(Group.objects.get_or_create(name=role)[0])
        options = {"viewport": {"width": 1360, "height": 900}, "accept_downloads": True, **context_options}
        page = new_context(**options).new_page()
        page.goto(f"{live_server.url}/login/")
        page.fill("input[name=username]", username)
        page.fill("input[name=password]", f"{username}-pw")
        page.click("button[type=submit]")
        page.wait_for_url(f"{live_server.url}/")
        return page

    return open_as


def shot(page, name: str) -> None:
    """A full-page screenshot, var/screenshots/NAME.png (kept by CI as an artefact)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
