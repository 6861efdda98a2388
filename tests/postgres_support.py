"""A real, throwaway PostgreSQL server for the tests of the shared ledger and quotas.

`PostgresServer`: initdb into a fresh temporary folder and `pg_ctl start` on a free port of 127.0.0.1
(its unix socket in the same folder), trust authentication, fsync off (the tests check behaviour, not
durability). initdb and postgres refuse to run as root: as root they run as the `postgres` user (or
`nobody`) through `runuser`, on a folder handed to that user. The binaries are looked for in
$DUOSPEC_PG_BIN, then /usr/lib/postgresql/<version>/bin, then PATH.

Fixtures: `postgres` (one server for the session) and `pg_url` (a fresh database on it per test). A
test that needs to stop its server makes its own (`PostgresServer().start()`, about a second). When
the binaries are absent or the server cannot start, the tests that need it skip, saying why.
"""

from __future__ import annotations

import glob
import os
import pathlib
import pwd
import shutil
import subprocess
import tempfile
import uuid

import pytest
from server_support import free_port

USER = "duo"  # the superuser initdb creates; trust auth, so the password in URLs is never checked
PASSWORD = "s3cret-pw"


def _bin_dir() -> pathlib.Path | None:
    candidates = [os.environ.get("DUOSPEC_PG_BIN", "")]
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)  # newest first
    on_path = shutil.which("initdb")
    candidates.append(str(pathlib.Path(on_path).parent) if on_path else "")
    for c in candidates:
        if c and all((pathlib.Path(c) / b).is_file() for b in ("initdb", "pg_ctl", "postgres")):
            return pathlib.Path(c)
    return None


def _run_as() -> list[str]:
    """The command prefix that drops root for initdb and postgres (nothing when not root)."""
    if os.geteuid() != 0:
        return []
    runuser = shutil.which("runuser")
    if runuser is None:
        raise RuntimeError("running as root and `runuser` is missing; PostgreSQL refuses to run as root")
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return [runuser, "-u", name, "--"]
    raise RuntimeError("running as root and there is neither a `postgres` nor a `nobody` user to run PostgreSQL as")



class PostgresServer:
    def __init__(self):
        self.bin = _bin_dir()
        self.dir: pathlib.Path | None = None
        self.port: int | None = None
        self._prefix: list[str] = []

    def start(self) -> "PostgresServer":
        """Starts a new server; raises RuntimeError (with the server's log) when it cannot."""
        if self.bin is None:
            raise RuntimeError("no PostgreSQL binaries (initdb, pg_ctl, postgres) in $DUOSPEC_PG_BIN, "
                               "/usr/lib/postgresql/*/bin or PATH; install postgresql")
        self._prefix = _run_as()
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="duospec-pg-"))
        if self._prefix:
            user = pwd.getpwnam(self._prefix[2])
            os.chown(self.dir, user.pw_uid, user.pw_gid)
        data = self.dir / "data"
        self._run("initdb", "-D", str(data), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync",
                  "--no-instructions")
        self.port = free_port()
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(data), "-o", options, "-l", str(self.dir / "server.log"), "-w", "-t", "30",
                  "start")
        return self

    def _run(self, binary: str, *args: str) -> subprocess.CompletedProcess:
        done = subprocess.run(self._prefix + [str(self.bin / binary), *args], capture_output=True, text=True,
                              timeout=60)
        if done.returncode != 0:
            log = self.dir / "server.log"
            tail = log.read_text()[-2000:] if log.is_file() else ""
            raise RuntimeError(f"{binary} failed ({done.returncode}): {done.stderr.strip()[-2000:]} {tail}")
        return done

    def url(self, database: str = "postgres", password: str = PASSWORD) -> str:
        return f"postgresql://{USER}:{password}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database; returns its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        """Stops the server at once (what a crash or a lost database looks like to its clients)."""
        if self.dir is not None and (self.dir / "data" / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.dir / "data"), "-m", "immediate", "-w", "stop")

    def remove(self) -> None:
        self.stop()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


def start_or_skip() -> PostgresServer:
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[serve]')")
    server = PostgresServer()
    try:
        return server.start()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        server.remove()
        pytest.skip(f"no PostgreSQL server for the tests: {exc}")


@pytest.fixture(scope="session")
def postgres():
    server = start_or_skip()
    yield server
    server.remove()


@pytest.fixture
def pg_url(postgres) -> str:
    return postgres.create_database()
