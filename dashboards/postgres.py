"""A local PostgreSQL for the job store: Debian's server binaries, on 127.0.0.1, data under a
folder of ours, a generated password kept in a file there (never on a command line).

`meshscope stack up --store` starts one; tests start their own. PostgreSQL refuses to run as
root, so when we are root the data folder belongs to the `postgres` user and the server runs as it.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

PG_USER = "meshscope"
PG_DATABASE = "postgres"
INSTALL_HINT = "apt-get install postgresql (Debian), or put initdb and pg_ctl on PATH"


class PostgresError(RuntimeError):
    """The local server could not be set up or started; the message says why."""


@dataclass(frozen=True)
class LocalPostgres:
    """A running local server: what a job store URL and password file need."""

    home: Path
    port: int
    host: str = "127.0.0.1"  # the first address it listens on
    tls: bool = False  # serves TLS with the certificate in `certificate`

    @property
    def url(self) -> str:
        """The job store URL (`--store`); the password is in `password_file`. With TLS the
        client verifies the server against its certificate (self-signed or a CA's)."""
        url = f"postgresql://{PG_USER}@{self.host}:{self.port}/{PG_DATABASE}"
        return url + (f"?sslmode=verify-ca&sslrootcert={self.certificate}" if self.tls else "")

    @property
    def certificate(self) -> Path:
        """The server's TLS certificate (what clients verify it by)."""
        return self.home / "server.crt"

    @property
    def password_file(self) -> Path:
        """The generated password (mode 0600)."""
        return self.home / "password"

    @property
    def data(self) -> Path:
        """The server's data folder."""
        return self.home / "data"


def find_pg_binary(name: str) -> str:
    """initdb / pg_ctl: on PATH, else the newest /usr/lib/postgresql/<v>/bin (Debian keeps them there)."""
    found = shutil.which(name)
    candidates = [found] if found else []
    candidates += sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise PostgresError(f"{name} not found: {INSTALL_HINT}")


def _as_server_user(cmd: list[str]) -> list[str]:
    """The server refuses root: run it as `postgres` then."""
    if os.geteuid() != 0:
        return cmd
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise PostgresError("running as root and there is no `postgres` user to run the server as") from None
    return ["runuser", "-u", "postgres", "--", *cmd]


def _own(path: Path) -> None:
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _initdb(server: LocalPostgres) -> None:
    """A new cluster with a generated password for PG_USER (scram), once per home."""
    server.home.mkdir(parents=True, exist_ok=True)
    if not server.password_file.exists():
        server.password_file.write_text(secrets.token_urlsafe(24) + "\n")
        server.password_file.chmod(0o600)
    server.data.mkdir(mode=0o700, exist_ok=True)
    _own(server.data)
    if os.geteuid() == 0 and subprocess.run(_as_server_user(["test", "-x", str(server.home)])).returncode:
        raise PostgresError(
            f"the postgres user cannot reach {server.home}: a folder above it is private to root"
        )
    pwfile = server.home / ".initdb-password"  # readable by the server user for initdb only
    pwfile.write_text(server.password_file.read_text())
    _own(pwfile)
    try:
        cmd = [find_pg_binary("initdb"), "-D", str(server.data), "-U", PG_USER, "--auth=scram-sha-256"]
        result = subprocess.run(
            _as_server_user([*cmd, f"--pwfile={pwfile}"]), capture_output=True, text=True, timeout=120
        )
    finally:
        pwfile.unlink()
    if result.returncode != 0:
        raise PostgresError(f"initdb failed: {result.stderr.strip()[-800:]}")


def _allow(server: LocalPostgres, networks: tuple[str, ...]) -> None:
    """Let the nodes' networks log in (with the password; over TLS only when it serves TLS):
    initdb allows loopback only."""
    hba = server.data / "pg_hba.conf"
    lines = hba.read_text().splitlines()
    kind = "hostssl" if server.tls else "host"
    wanted = [f"{kind} all {PG_USER} {net} scram-sha-256" for net in networks]
    missing = [line for line in wanted if line not in lines]
    if missing:
        hba.write_text("\n".join([*lines, *missing]) + "\n")


def start(
    home: Path,
    port: int,
    *,
    listen: tuple[str, ...] = ("127.0.0.1",),
    allow: tuple[str, ...] = (),
    tls: tuple[Path, Path] | None = None,
    timeout_s: float = 60.0,
) -> LocalPostgres:
    """Start (initialising on first use) a server on `listen`:port that logs in loopback and
    the `allow` networks (CIDRs: the nodes of a job); with `tls` (certificate, key) it serves
    TLS and those networks log in over it only. Returns once it accepts."""
    server = LocalPostgres(Path(home).resolve(), port, listen[0], tls=tls is not None)
    if not (server.data / "PG_VERSION").exists():
        _initdb(server)
    _allow(server, allow)
    options = f"-c listen_addresses={','.join(listen)} -p {port} -k {server.data}"
    if tls is not None:
        options += " " + _serve_tls(server, *tls)
    log = server.home / "postgres.log"
    log.touch()
    _own(log)
    cmd = [find_pg_binary("pg_ctl"), "-D", str(server.data), "-o", options, "-l", str(log), "-w"]
    result = subprocess.run(
        _as_server_user([*cmd, "-t", str(int(timeout_s)), "start"]), capture_output=True, text=True
    )
    if result.returncode != 0:
        tail = log.read_text()[-800:] if log.exists() else ""
        raise PostgresError(f"postgres did not start on 127.0.0.1:{port}: {result.stderr.strip()} {tail}")
    return server


def _serve_tls(server: LocalPostgres, certificate: Path, key: Path) -> str:
    """The certificate and key where the server reads them (the key private to its user, as
    PostgreSQL demands); the options that turn TLS on."""
    shutil.copyfile(certificate, server.certificate)
    server.certificate.chmod(0o644)
    key_copy = server.home / "server.key"
    shutil.copyfile(key, key_copy)
    key_copy.chmod(0o600)
    _own(key_copy)
    return f"-c ssl=on -c ssl_cert_file={server.certificate} -c ssl_key_file={key_copy}"


def stop(home: Path, timeout_s: float = 30.0) -> bool:
    """Stop the server of `home` (fast: open sessions are ended); False when none was running."""
    data = Path(home).resolve() / "data"
    if not (data / "postmaster.pid").exists():
        return False
    cmd = [find_pg_binary("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", str(int(timeout_s)), "stop"]
    result = subprocess.run(_as_server_user(cmd), capture_output=True, text=True)
    return result.returncode == 0


def wait_ready(server: LocalPostgres, timeout_s: float = 30.0) -> None:
    """Block until the server takes a login (pg_ctl -w says started a moment before it does)."""
    import psycopg

    deadline = time.monotonic() + timeout_s
    password = server.password_file.read_text().strip()
    while True:
        try:
            psycopg.connect(server.url, password=password, connect_timeout=2).close()
            return
        except psycopg.OperationalError as err:
            if time.monotonic() > deadline:
                raise PostgresError(f"postgres on {server.url} takes no login: {err}") from None
            time.sleep(0.1)
