"""``manage.py run_local`` (what ``make run`` starts): the console and the embedded executor, side
by side, under one small supervisor.

- When the executor exits and nobody asked it to, the supervisor says so on stderr, loudly, with
  its exit status (or the signal that killed it), and starts it again after a short backoff
  (BACKOFF: 1, 2, 4 … 30 s; back to the first once it stayed up for STEADY seconds), so that a
  crash loop (a failpoint armed in the environment, say) restarts it a few times a minute, no more.
- When the console exits, the supervisor says so, stops the executor and exits with status 1.
- On SIGINT (Ctrl-C) or SIGTERM it stops both (SIGTERM: the executor leaves between two runs and
  marks itself stopped), waits up to GRACE seconds, kills what is left, and exits 0.

Each child runs in its own process group, so that a Ctrl-C in the terminal reaches the supervisor
alone and the stop is done in order; on Linux a child also gets SIGTERM should the supervisor die.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

BACKOFF = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # seconds before restart 1, 2, 3 … of a crash loop
STEADY = 60.0  # an executor up this long is well: the next restart waits BACKOFF[0] again
GRACE = 30.0  # seconds each child is given to stop on SIGTERM before it is killed
POLL = 0.2  # seconds between looks at the children


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, between fork and exec
    """Linux: SIGTERM this child when the supervisor dies (prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def exit_text(status: int) -> str:
    """ "exited with status 3", or "was killed by signal 9 (SIGKILL)" (Popen's negative status)."""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {-status} ({name})"
    return f"exited with status {status}"


class Supervisor:
    def __init__(
        self,
        *,
        executor: Sequence[str],
        console: Sequence[str],
        err: TextIO = sys.stderr,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.executor_argv, self.console_argv = list(executor), list(console)
        self.err, self.sleep = err, sleep
        self.stopping = False
        self.restarts = 0  # restarts of the current crash loop
        self.executor: subprocess.Popen | None = None
        self.console: subprocess.Popen | None = None

    def say(self, line: str) -> None:
        print(line, file=self.err, flush=True)

    def _start(self, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(argv, process_group=0, preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    def _stop_on_signal(self, signum: int, frame: object) -> None:
        if not self.stopping:
            self.say(f"run_local: {signal.Signals(signum).name}: stopping the executor and the console")
        self.stopping = True

    def run(self) -> int:
        """Until stopped. Returns the exit status: 0 when asked to stop, 1 when the console died."""
        previous = {s: signal.signal(s, self._stop_on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.console = self._start(self.console_argv)
            self.executor = self._start(self.executor_argv)
            self.say(f"run_local: console pid {self.console.pid}, executor pid {self.executor.pid}")
            started = time.monotonic()
            while not self.stopping:
                if self.console.poll() is not None:
                    self.say(
                        f"!!! run_local: the console (pid {self.console.pid}) {exit_text(self.console.returncode)}: "
                        "stopping the executor too"
                    )
                    self._stop_all()
                    return 1
                if self.executor.poll() is not None:
                    started = self._restart_executor(started)
                    continue
                self.sleep(POLL)
            self._stop_all()
            return 0
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _restart_executor(self, started: float) -> float:
        assert self.executor is not None
        if time.monotonic() - started >= STEADY:
            self.restarts = 0
        delay = BACKOFF[min(self.restarts, len(BACKOFF) - 1)]
        self.restarts += 1
        self.say(
            f"!!! run_local: the executor (run_executor, pid {self.executor.pid}) {exit_text(self.executor.returncode)}"
            f" — runs are NOT moving. Restarting it in {delay:.0f} s (restart {self.restarts} in a row)."
        )
        deadline = time.monotonic() + delay
        while not self.stopping and time.monotonic() < deadline:
            self.sleep(POLL)
        if self.stopping:
            return started
        self.executor = self._start(self.executor_argv)
        self.say(f"run_local: executor restarted, pid {self.executor.pid}")
        return time.monotonic()

    def _stop_all(self) -> None:
        children = [c for c in (self.executor, self.console) if c is not None and c.poll() is None]
        for child in children:
            try:
                child.terminate()
            except ProcessLookupError:
                pass
        for child in children:
            try:
                child.wait(GRACE)
            except subprocess.TimeoutExpired:
                self.say(f"run_local: pid {child.pid} did not stop within {GRACE:.0f} s: killing it")
                child.kill()
                child.wait()
        self.say("run_local: stopped")


def manage_argv(*args: str) -> list[str]:
    """``python manage.py ARGS`` with this interpreter and the manage.py this process was started with."""
    manage = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0].endswith("manage.py") else "manage.py"
    return [sys.executable, manage, *args]
