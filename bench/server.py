"""A real console server for the benchmarks: gunicorn serving ``config.wsgi`` on 127.0.0.1 with
production settings (``DJANGO_DEBUG=0``, a random ``DJANGO_SECRET_KEY``,
``DJANGO_ALLOWED_HOSTS=127.0.0.1``) plus the query counter of ``bench/console_settings.py``, and a
logged-in HTTP session (``/login/`` with its CSRF token, then the session cookie)."""

from __future__ import annotations

import html
import http.client
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from pathlib import Path
from urllib.parse import urlencode

from bench.seed import ROOT, django_env, manage

GUNICORN = str(Path(sys.executable).with_name("gunicorn"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def gunicorn_argv(port: int, workers: int, *options: str) -> list[str]:
    """``gunicorn config.wsgi`` with ``workers`` sync workers on 127.0.0.1:``port``."""
    return [
        GUNICORN,
        "config.wsgi:application",
        "--bind",
        f"127.0.0.1:{port}",
        "--workers",
        str(workers),
        "--worker-class",
        "sync",
        *options,
        "--log-level",
        "warning",
    ]


def create_supervisor(db_url: str, username: str = "bench-supervisor") -> tuple[str, str]:
    """``manage.py createoperator USERNAME --group supervisor --password … --reason …``; (username, password)."""
    password = secrets.token_urlsafe(16)  # 22 characters: passes the password validators
    manage(db_url, "createoperator", username, "--group", "supervisor", "--password", password, "--reason", "the bench")
    return username, password


@dataclass
class Server:
    """``gunicorn config.wsgi`` in its own process group; ``stop()`` ends it (and its workers)."""

    db_url: str
    log_dir: Path
    workers: int = 1
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    process: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> Server:
        self.port = free_port()
        log = open(self.log_dir / f"gunicorn-{self.port}.log", "w")  # noqa: SIM115 - closed with the process
        env = django_env(self.db_url, DJANGO_SETTINGS_MODULE="bench.console_settings", **self.env)
        argv = gunicorn_argv(self.port, self.workers, "--timeout", "0")  # a long export is not a hung worker
        self.process = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"gunicorn exited ({self.process.returncode}); see {log.name}")
            try:
                if Session(self.port).get("/login/").status == 200 and len(self.worker_pids()) == self.workers:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"gunicorn did not answer within {timeout:.0f}s; see {log.name}")

    def worker_pids(self) -> list[int]:
        assert self.process is not None
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        try:
            return [int(pid) for pid in children.read_text().split()]
        except FileNotFoundError:
            return []

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def memory_kib(pid: int, field_name: str) -> int:
    """``VmHWM`` (peak resident set) or ``VmRSS`` of a process, in KiB, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise LookupError(field_name)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name.lower(), default)


class Session:
    """A browser-like session over http.client: keeps cookies, nothing else (no redirects)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.cookies: dict[str, str] = {}

    def _send(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        all_headers = {"Host": f"127.0.0.1:{self.port}", **headers}
        if self.cookies:
            all_headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        conn.request(method, path, body=body, headers=all_headers)
        response = conn.getresponse()
        for value in response.headers.get_all("Set-Cookie") or []:
            cookie: SimpleCookie = SimpleCookie()
            cookie.load(value)
            for name, morsel in cookie.items():
                self.cookies[name] = morsel.value
        return response

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None):
        response = self._send(method, path, body, headers or {})
        try:
            data = response.read()
        finally:
            response.close()
        return Response(response.status, {k.lower(): v for k, v in response.getheaders()}, data)

    def get(self, path: str, headers: dict[str, str] | None = None) -> Response:
        return self.request("GET", path, headers=headers)

    def stream(self, path: str, chunk: int = 1 << 20) -> Iterator[bytes]:
        """The body of a GET, ``chunk`` bytes at a time (raises on a status other than 200)."""
        response = self._send("GET", path, None, {})
        try:
            if response.status != 200:
                raise RuntimeError(f"GET {path}: {response.status} {response.read()[:300]!r}")
            while data := response.read(chunk):
                yield data
        finally:
            response.close()

    def login(self, username: str, password: str) -> None:
        page = self.get("/login/")
        match = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', page.body)
        if page.status != 200 or not match:
            raise SystemExit(f"GET /login/: {page.status}, no CSRF token")
        form = {"username": username, "password": password, "csrfmiddlewaretoken": match.group(1).decode(), "next": "/"}
        answer = self.request(
            "POST",
            "/login/",
            body=urlencode(form).encode(),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        if answer.status != 302 or "sessionid" not in self.cookies:
            raise SystemExit(f"POST /login/: {answer.status}, not logged in")


def next_link(body: bytes) -> str | None:
    """The runs list's ``rel="next"`` link (keyset cursor), as a path."""
    match = re.search(rb'<a href="([^"]*)" rel="next">', body)
    return "/" + html.unescape(match.group(1).decode()) if match else None
