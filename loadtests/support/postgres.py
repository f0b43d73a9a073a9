"""A real PostgreSQL for the tests and the benchmarks: Debian's ``postgresql``
package, a throwaway cluster (:mod:`tests.support.postgres` re-exports this).

:func:`postgres_cluster` runs ``initdb`` in a temporary directory, starts the server
on a free loopback port (its unix socket in that directory too) and stops it after.
PostgreSQL refuses to run as root, so as root the cluster runs as the unprivileged
``postgres`` user the package creates (through ``runuser``). :func:`fresh_database`
makes a new empty database on it and gives its DSN: one per test keeps tests apart.

By default the cluster trades durability for speed (``fsync=off``): the tests kill
the proxy, never the database. ``durable=True`` keeps PostgreSQL's defaults (the
benchmarks measure with them).
"""

from __future__ import annotations

import contextlib
import getpass
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from loadtests.support.processes import LOOPBACK, free_port

DEBIAN_BINARIES = "/usr/lib/postgresql/*/bin"
SERVICE_USER = "postgres"  # the user Debian's package makes


def bin_dir() -> Path:
    """The newest installed PostgreSQL's ``bin``; else where ``initdb`` is on PATH."""
    found = sorted(glob.glob(DEBIAN_BINARIES), key=lambda p: int(Path(p).parent.name))
    if found:
        return Path(found[-1])
    on_path = shutil.which("initdb")
    if on_path is None:
        raise RuntimeError("PostgreSQL is not installed: apt-get install postgresql")
    return Path(on_path).resolve().parent


@dataclass(frozen=True)
class Cluster:
    """A running cluster: superuser ``user``, no password (trust on loopback)."""

    port: int
    user: str
    socket_dir: Path
    data: Path
    log: Path
    options: str = ""  # the server's command-line options (pg_ctl -o)
    run_as: str | None = None  # the system user it runs as (root cannot)

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://{self.user}@{LOOPBACK}:{self.port}/{dbname}"

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _as_user(user: str | None, argv: Sequence[str]) -> list[str]:
    return ["runuser", "-u", user, "--", *argv] if user else list(argv)


@contextmanager
def postgres_cluster(durable: bool = False) -> Iterator[Cluster]:
    """Start a throwaway cluster; stop it and remove its files after."""
    binaries = bin_dir()
    root = Path(tempfile.mkdtemp(prefix="whoseturn-pg-"))
    run_as: str | None = None
    user = getpass.getuser()
    if os.geteuid() == 0:
        run_as = user = SERVICE_USER
        entry = pwd.getpwnam(SERVICE_USER)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    data, log = root / "data", root / "postgres.log"
    port = free_port()
    subprocess.run(
        _as_user(run_as, [str(binaries / "initdb"), "-D", str(data), "-U", user,
                          "--auth=trust", "--encoding=UTF8", "--no-sync"]),
        check=True, capture_output=True,
    )  # fmt: skip
    options = f"-p {port} -k {root} -c listen_addresses={LOOPBACK} -c max_connections=200"
    if not durable:
        options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
    start = [str(binaries / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w"]
    cluster = Cluster(port, user, root, data, log, options, run_as)
    try:
        done = subprocess.run(_as_user(run_as, [*start, "start"]), capture_output=True)
        if done.returncode != 0:
            raise RuntimeError(f"PostgreSQL did not start:\n{cluster.tail()}")
        yield cluster
    finally:
        stop = [str(binaries / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]
        subprocess.run(_as_user(run_as, stop), capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def fresh_database(admin_dsn: str, prefix: str = "t") -> str:
    """Create an empty database through ``admin_dsn``; the new database's DSN."""
    import psycopg  # imported here: tests without PostgreSQL need not load it
    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return make_conninfo(admin_dsn, dbname=name)


def _pg_ctl(cluster: Cluster, *args: str) -> None:
    command = [str(bin_dir() / "pg_ctl"), "-D", str(cluster.data), *args]
    done = subprocess.run(_as_user(cluster.run_as, command), capture_output=True)
    if done.returncode != 0:
        raise RuntimeError(f"pg_ctl {' '.join(args)} failed:\n{cluster.tail()}")


def stop(cluster: Cluster, mode: str = "fast") -> None:
    """Shut the server down (``fast``: its sessions are ended, as an operator's
    restart does); its data stays."""
    _pg_ctl(cluster, "-m", mode, "-w", "stop")


def start(cluster: Cluster) -> None:
    """Start a stopped cluster again, on the same port, with the same options."""
    _pg_ctl(cluster, "-l", str(cluster.log), "-o", cluster.options, "-w", "start")


def server_pids(cluster: Cluster) -> list[int]:
    """The postmaster and every process it runs (each backend is a session leader of
    its own, so a process group does not reach them)."""
    import psutil  # a dev dependency; only the tests pause a server

    postmaster = int((cluster.data / "postmaster.pid").read_text().split()[0])
    main = psutil.Process(postmaster)
    return [postmaster, *(p.pid for p in main.children(recursive=True))]


@contextmanager
def paused(cluster: Cluster) -> Iterator[None]:
    """The whole server stopped (SIGSTOP) while the block runs: connections stay
    open and nothing answers, as a hung host or a stalled disk looks from outside."""
    import signal

    def send(pids: list[int], sig: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # one that had just ended
                os.kill(pid, sig)

    postmaster = server_pids(cluster)[0]
    send([postmaster], signal.SIGSTOP)  # first: it starts no new process after
    pids = list(dict.fromkeys(server_pids(cluster)))
    send(pids[1:], signal.SIGSTOP)
    try:
        yield
    finally:
        send(pids, signal.SIGCONT)
