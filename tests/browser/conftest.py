"""Browser tests drive Debian's Chromium with Playwright (its own browser download does not work
here): one browser per test module, launched headless with the flags below."""

import os
import shutil

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

needs_chromium = pytest.mark.skipif(
    not shutil.which(CHROMIUM), reason="needs Debian's chromium (apt-get install -y chromium)"
)


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
