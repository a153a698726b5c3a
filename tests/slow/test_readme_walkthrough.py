"""The README's "Break a run on purpose" runs as written.

Every line of its shell blocks runs in order, verbatim, from the checkout, against a product
started the way the README starts it (`make run`, on SQLite files of the test's own and a port of
its own). A `make run` line stops the running product as Ctrl-C would and starts it again. Every
other line must exit 0, and a line's trailing comment is a claim the test checks: `show_run …
--wait` names the state the run rests in; `sandbox counts --run` names numbers that run's
objects must have (no second task, no message sent twice).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

# Its product runs on SQLite files of its own whatever the suite uses: CI runs it once (storage_agnostic).
pytestmark = [pytest.mark.slow, pytest.mark.storage_agnostic]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SECTION = ("### Break a run on purpose", "### Fix it from the console")
# Hang guards, not timing assumptions: the product's first start seeds the demo, and each
# command waits on the engine's own state (`--wait`), never on a sleep.
START_TIMEOUT = 600
COMMAND_TIMEOUT = 900
COMMENT = re.compile(r"\s+#\s+(?=[^'\"]*$)")  # a trailing comment: no quote after it


def walkthrough() -> list[tuple[str, str]]:
    """(command, trailing comment) for every line of the section's shell blocks, in order."""
    text = README.read_text()
    start, end = text.index(SECTION[0]), text.index(SECTION[1])
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", text[start:end], flags=re.S):
        for line in block.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            match = COMMENT.search(line)
            command, comment = (line[: match.start()], line[match.end() :]) if match else (line, "")
            lines.append((command.strip(), comment.strip()))
    return lines


def test_the_walkthrough_is_read_as_commands_and_claims():
    lines = walkthrough()
    commands = [command for command, _ in lines]
    assert commands[0] == ".venv/bin/python manage.py sandbox fault tasks create commit_then_drop"
    assert sum(1 for c in commands if c.endswith("make run")) == 2
    claims = dict(lines)
    assert claims[".venv/bin/python manage.py sandbox counts --run invoice:tenant-42:inv-1847"] == (
        "tasks=1 messages=1 ledger_entries=1"
    )
    assert all(c.startswith(".venv/bin/python manage.py ") or c.endswith("make run") for c in commands)


class Product:
    """`make run` in a process group of its own, stopped as Ctrl-C stops it."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env = env
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self, line: str) -> None:
        self.stop()
        with self.log.open("a") as out:
            out.write(f"\n$ {line}\n")
            self.proc = subprocess.Popen(
                ["bash", "-c", line],
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        url = f"http://127.0.0.1:{self.env['PORT']}/login/"
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"`{line}` exited {self.proc.returncode}:\n{self.log.read_text()[-4000:]}"
            try:
                if httpx.get(url, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        pytest.fail(f"`{line}` did not answer on {url} within {START_TIMEOUT} s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def product_env(tmp_path):
    keep = {"PATH", "HOME", "LANG", "LC_ALL", "PYENV_VERSION", "TMPDIR"}
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(
        PORT=str(_free_port()),
        DATABASE_URL=f"sqlite:///{tmp_path / 'recovery.sqlite3'}",
        SANDBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'sandbox.sqlite3'}",
    )
    return env


def test_the_readme_walkthrough_runs_verbatim(product_env, tmp_path):
    product = Product(product_env, tmp_path / "make-run.log")
    product.start("make run")  # "With `make run` going in one terminal"
    try:
        for command, claim in walkthrough():
            if command.endswith("make run"):
                product.start(command)
                continue
            done = subprocess.run(
                ["bash", "-c", command],
                cwd=ROOT,
                env=product_env,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT,
            )
            assert done.returncode == 0, f"`{command}` exited {done.returncode}: {done.stderr.strip()}\n{done.stdout}"
            _check(command, claim, done.stdout)
    finally:
        product.stop()


def _check(command: str, claim: str, output: str) -> None:
    if " show_run " in command and claim:
        state = re.match(r"\w+", claim).group()
        assert output.split()[1] == state, f"`{command}` claims {state}:\n{output}"
    if " sandbox counts --run " in command:
        printed = dict(pair.split("=") for pair in output.split())
        claimed = dict(pair.split("=") for pair in claim.split())
        assert claimed and {k: printed.get(k) for k in claimed} == claimed, f"`{command}` claims {claim}:\n{output}"
