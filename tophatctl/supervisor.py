"""Keep a running mesh running: restart what dies, with backoff, and say where everything is.

`tophat serve` owns one `Supervisor` (through `Mesh.start()` / `Mesh.stop()`). A thread polls the
mesh's processes; one that exited is logged with its exit code and started again after a delay
(the project's exponential backoff, shared/net/backoff.py: 0.5 s doubling up to 10 s, back to 0.5 s for
a process that had stayed up 30 s, as compose's restart policy does), with the same command line,
environment and ports -- a device in
a network namespace comes back in the same namespace, its command carries the `ip netns exec`
prefix. The embedded Redis comes back on its port with its password.

After every start and restart the state file (when given) is rewritten atomically (temp file and
rename): a JSON list of `{"role", "name", "pid", "url"}`, one per process, so operators and tests
can find and signal them. Redis's URL in it is redacted.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from shared.net.backoff import Backoff
from shared.processes.redis_server import EmbeddedRedis
from tophatctl.service_process import ServiceProcess

log = logging.getLogger(__name__)

REDIS = "redis"


class SupervisedMesh(Protocol):
    """What the supervisor watches (tophatctl/mesh.py's Mesh): its processes, its embedded Redis (None when
    it uses an outside one) and the table the state file lists."""

    services: list[ServiceProcess]
    redis: EmbeddedRedis | None

    def process_table(self) -> list[dict]: ...


@dataclass(frozen=True)
class RestartPolicy:
    initial_s: float = 0.5
    max_s: float = 10.0
    reset_after_s: float = 30.0  # a process that stayed up this long starts over at initial_s
    backoff: Backoff = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.reset_after_s <= 0:
            raise ValueError(f"reset_after_s must be positive, got {self.reset_after_s}")
        # Made here, so a bad initial_s / max_s fails now rather than at the first crash.
        object.__setattr__(self, "backoff", Backoff(self.initial_s, self.max_s))

    def next_delay(self, previous_s: float | None, uptime_s: float) -> float:
        """Seconds to wait before restarting a process that ran `uptime_s` before it exited."""
        if uptime_s >= self.reset_after_s:
            previous_s = None  # it stayed up: this crash is a first one
        return self.backoff.after(previous_s)


@dataclass
class _Pending:
    """A process seen dead, waiting for its restart."""

    delay_s: float
    due: float


def write_state_file(path: Path, entries: list[dict]) -> None:
    """Atomically replace `path` with `entries` as JSON: a reader sees the old list or the new one."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(json.dumps(entries, indent=1) + "\n")
    os.replace(temp, path)


class Supervisor:
    def __init__(
        self,
        mesh: SupervisedMesh,
        state_file: Path | None = None,
        policy: RestartPolicy = RestartPolicy(),
        poll_s: float = 0.2,
    ):
        self.mesh = mesh
        self.state_file = state_file
        self.policy = policy
        self.poll_s = poll_s
        self.restarts: dict[str, int] = {}  # by process name
        self._pending: dict[str, _Pending] = {}
        self._delays: dict[str, float] = {}  # the last delay used, per name (the backoff's memory)
        self._redis_started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Supervisor:
        self.write_state()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="mesh-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop supervising (before the mesh stops its processes, so stopping restarts nothing)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def write_state(self) -> None:
        if self.state_file is None:
            return
        try:
            write_state_file(self.state_file, self.mesh.process_table())
        except OSError as exc:
            log.error("cannot write the state file %s: %s", self.state_file, exc)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the supervisor must outlive a failed restart; it retries
                log.exception("supervision round failed")

    def check(self) -> None:
        """One round: note the newly dead, restart those whose delay is over."""
        now = time.monotonic()
        for service in list(self.mesh.services):
            code = service.process.poll()
            if code is not None:
                self._due(service.name, code, now - service.started_at, now)
                if self._restart_due(service.name, now):
                    service.restart()
                    self._restarted(service.name, service.process.pid)
        redis = self.mesh.redis
        if redis is not None and not redis.running:
            self._due(REDIS, redis.returncode, now - self._redis_started, now)
            if self._restart_due(REDIS, now):
                redis.stop()  # frees what the dead one left (its temp dir); start() keeps port and password
                redis.start()
                self._redis_started = time.monotonic()
                self._restarted(REDIS, redis.pid)

    def _due(self, name: str, code: int | None, uptime_s: float, now: float) -> None:
        if name in self._pending:
            return
        delay = self.policy.next_delay(self._delays.get(name), uptime_s)
        self._delays[name] = delay
        self._pending[name] = _Pending(delay, now + delay)
        log.warning("%s exited with %s after %.1f s; restarting it in %.1f s", name, code, uptime_s, delay)

    def _restart_due(self, name: str, now: float) -> bool:
        pending = self._pending.get(name)
        if pending is None or now < pending.due or self._stop.is_set():
            return False
        del self._pending[name]
        return True

    def _restarted(self, name: str, pid: int | None) -> None:
        self.restarts[name] = self.restarts.get(name, 0) + 1
        log.info("%s restarted (pid %s, restart %d)", name, pid, self.restarts[name])
        self.write_state()
