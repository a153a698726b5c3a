"""A throwaway PostgreSQL cluster for tests that must stop, crash or restart the database.

Never the machine's shared server: ``initdb`` in a temporary directory, listening on a free port
on 127.0.0.1 only (and on a unix socket inside that directory), trust authentication, no fsync
(harmless for a server crash, which is what ``immediate`` is; only a machine crash would lose data).
initdb and postgres refuse to run as root, so as root they run as the ``postgres`` OS user
(``runuser -u postgres --``) in a directory handed to that user; as anyone else, as that user.

    with pgcluster.cluster() as pg:          # pytest.skip()s if the binaries are missing
        pg.create_database("recovery")
        url = pg.url("recovery")             # postgres://postgres@127.0.0.1:PORT/recovery
        pg.restart(mode="fast")              # or "immediate" (a crash: recovery from the WAL)
    # stopped and removed here, on success or failure

No pytest fixture is defined here: a test module wraps ``cluster()`` in the fixture it needs.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SUPERUSER = "postgres"  # the cluster's own superuser (initdb -U), trusted on 127.0.0.1
OS_USER = "postgres"  # who runs initdb and the server when this process is root
STOP_MODES = ("smart", "fast", "immediate")
PG_CTL_WAIT = 60  # seconds pg_ctl -w waits for a start or a stop: a hang guard


class ClusterUnavailable(Exception):
    """No usable PostgreSQL binaries (or no unprivileged user to run them as) on this machine."""


def find_bindir() -> Path:
    """The newest ``/usr/lib/postgresql/*/bin`` (or ``$PG_BINDIR``) holding initdb, pg_ctl and
    postgres; ClusterUnavailable if there is none."""
    candidates = [os.environ["PG_BINDIR"]] if os.environ.get("PG_BINDIR") else []
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key, reverse=True)
    for candidate in candidates:
        path = Path(candidate)
        if all(os.access(path / tool, os.X_OK) for tool in ("initdb", "pg_ctl", "postgres", "createdb")):
            return path
    raise ClusterUnavailable("no PostgreSQL server binaries (initdb, pg_ctl, postgres) under /usr/lib/postgresql/*/bin")


def check_available() -> Path:
    """The bindir (``find_bindir``), once it is clear a cluster can be made here: as root, with
    ``runuser`` and a ``postgres`` OS user to run it as. ClusterUnavailable with the reason if not.
    For a caller outside pytest that must say so up front (bench/soak.py exits 2)."""
    bindir = find_bindir()
    _run_as_prefix()
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(OS_USER)
        except KeyError:
            raise ClusterUnavailable(
                f"running as root and there is no {OS_USER!r} OS user to run PostgreSQL as"
            ) from None
    return bindir


def _version_key(path: str) -> tuple:
    version = Path(path).parent.name
    return tuple(int(part) if part.isdigit() else 0 for part in version.split("."))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgCluster:
    """One cluster: ``start``, ``stop``, ``restart``; its data, socket and log live in ``base``."""

    def __init__(self, *, bindir: Path, base: Path, port: int, settings: dict[str, str] | None = None):
        self.bindir = bindir
        self.base = base
        self.port = port
        self.data = base / "data"
        self.log = base / "server.log"
        self.settings = settings or {}
        self.running = False
        self._as_user = _run_as_prefix()

    # --- addresses --------------------------------------------------------------------

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def socket_dir(self) -> Path:
        return self.base

    def url(self, dbname: str = "postgres") -> str:
        """A libpq / dj-database-url URL for ``dbname`` as the cluster's superuser over TCP."""
        return f"postgres://{SUPERUSER}@{self.host}:{self.port}/{dbname}"

    # --- life cycle -------------------------------------------------------------------

    def init(self) -> None:
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            SUPERUSER,
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        )
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.socket_dir}'",
            # No fsync: a stop -m immediate (a crash of the server, not of the machine) loses no
            # committed transaction, since the WAL is written at commit. Never synchronous_commit=off
            # here: it would lose the last commits at a crash, and a test would see a checkpoint
            # its process saw committed vanish (no production server runs so).
            "fsync": "off",
            "max_connections": "100",
            "logging_collector": "off",
            **self.settings,
        }
        # Appended as this process (root or not): the file keeps its owner.
        with open(self.data / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.write("\n# tests/support/pgcluster.py\n")
            conf.writelines(f"{name} = {value}\n" for name, value in settings.items())

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", str(PG_CTL_WAIT), "start")
        self.running = True

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``smart``, ``fast``: terminates every session, ``immediate``: as a
        crash). Does nothing if it is not running."""
        if mode not in STOP_MODES:
            raise ValueError(f"stop mode must be one of {STOP_MODES}, not {mode!r}")
        if not (self.data / "postmaster.pid").exists():
            self.running = False
            return
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", str(PG_CTL_WAIT), "stop", "-m", mode)
        self.running = False

    def restart(self, mode: str = "fast") -> None:
        """Stop with ``mode``, then start again on the same port and socket."""
        self.stop(mode)
        self.start()

    def create_database(self, name: str) -> None:
        self._run("createdb", "-h", str(self.socket_dir), "-p", str(self.port), "-U", SUPERUSER, name)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _run(self, tool: str, *args: str) -> str:
        argv = [*self._as_user, str(self.bindir / tool), *args]
        out = self.base / "pg_ctl.out"  # a file, not a pipe: the server pg_ctl starts must not hold it open
        with open(out, "w+", encoding="utf-8") as sink:
            try:
                done = subprocess.run(
                    argv,
                    cwd=self.base,  # the postgres user may not read the caller's working directory
                    stdin=subprocess.DEVNULL,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "LC_ALL": "C", "LANG": "C", "PGTZ": "UTC"},
                    timeout=PG_CTL_WAIT + 30,
                )
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{tool} did not finish in {PG_CTL_WAIT + 30} s\n{self.log_tail()}") from None
            sink.seek(0)
            output = sink.read()
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited {done.returncode}:\n{output}\n--- server log ---\n{self.log_tail()}"
            )
        return output


def _run_as_prefix() -> list[str]:
    if os.geteuid() != 0:
        return []
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    if not os.access(runuser, os.X_OK):
        raise ClusterUnavailable("running as root without runuser: initdb and postgres refuse to run as root")
    return [runuser, "-u", OS_USER, "--"]


def _handed_to_server_user(path: Path) -> None:
    if os.geteuid() != 0:
        return
    try:
        entry = pwd.getpwnam(OS_USER)
    except KeyError:
        raise ClusterUnavailable(f"running as root and there is no {OS_USER!r} OS user to run PostgreSQL as") from None
    os.chown(path, entry.pw_uid, entry.pw_gid)


@contextmanager
def cluster(*, settings: dict[str, str] | None = None, skip: bool = True, keep: bool = False) -> Iterator[PgCluster]:
    """A started cluster, stopped (immediately) and removed on the way out, whatever happened.
    Without the binaries: ``pytest.skip`` with the reason (``skip=False``: ClusterUnavailable).
    ``keep=True``: stopped cleanly (``fast``) instead, and its directory left in place (``base``)."""
    try:
        bindir = find_bindir()
        _run_as_prefix()
    except ClusterUnavailable as exc:
        if not skip:
            raise
        import pytest

        pytest.skip(f"no throwaway PostgreSQL cluster: {exc}")
    base = Path(tempfile.mkdtemp(prefix="pgcluster-"))
    pg = None
    try:
        try:
            _handed_to_server_user(base)
        except ClusterUnavailable as exc:
            if not skip:
                raise
            import pytest

            pytest.skip(f"no throwaway PostgreSQL cluster: {exc}")
        pg = PgCluster(bindir=bindir, base=base, port=free_port(), settings=settings)
        pg.init()
        pg.start()
        yield pg
    finally:
        try:
            if pg is not None:
                pg.stop("fast" if keep else "immediate")
        finally:
            if not (keep and pg is not None):
                shutil.rmtree(base, ignore_errors=True)
