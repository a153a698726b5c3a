"""Where the demo's seed reaches the simulated systems: the sandbox already answering at a URL
(``make run``'s server), or a temporary in-process server for the seed's duration."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from django.conf import settings
from django.core.management.base import CommandError
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler
from django.core.wsgi import get_wsgi_application


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):
        pass


class _Server(ThreadedWSGIServer):
    daemon_threads = False  # server_close() waits for requests in flight (a dropped answer's delay)


@contextmanager
def sandbox_server(url: str) -> Iterator[str]:
    """Yield the URL of a server answering the sandbox endpoints: ``url`` if the sandbox
    answers there, else a temporary in-process server on a free local port, stopped on exit."""
    if _sandbox_answers(url):
        yield url
        return
    httpd = _Server(("127.0.0.1", 0), _QuietHandler)
    httpd.set_app(get_wsgi_application())
    thread = threading.Thread(target=httpd.serve_forever, name="seed-demo-sandbox", daemon=True)
    thread.start()
    # The faults' 4xx and 5xx answers are the point of the demo, not errors worth printing.
    request_log = logging.getLogger("django.request")
    level = request_log.level
    request_log.setLevel(logging.CRITICAL)
    try:
        served = f"http://127.0.0.1:{httpd.server_address[1]}"
        if not _sandbox_answers(served):
            raise CommandError(f"the temporary sandbox server at {served} does not answer (is 127.0.0.1 allowed?)")
        yield served
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)
        request_log.setLevel(level)


def _sandbox_answers(url: str) -> bool:
    """True if the sandbox answers at ``url``, False if nothing listens there; anything else
    listening there is an error."""
    try:
        response = httpx.get(
            f"{url}/sandbox/tasks/",
            params={"idempotency_key": "seed-demo-probe"},
            headers={"Authorization": f"Bearer {settings.SANDBOX_API_KEY}"},
            timeout=5,
        )
    except httpx.ConnectError:
        return False
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise CommandError(f"{url} does not answer like the sandbox: {type(exc).__name__}: {exc}") from None
    try:
        ok = response.status_code == 200 and "results" in response.json()
    except ValueError:
        ok = False
    if not ok:
        raise CommandError(f"{url} answers, but not as the sandbox (HTTP {response.status_code})")
    return True
