"""Children that die with the process that started them, however it dies (SIGKILL included).

A launcher killed with SIGKILL runs no cleanup, so its children must notice on their own. Two ways:

* `Tether`: a pipe whose write end only the launcher holds (non-inheritable); every Python child
  inherits the read end (its number in TOPHAT_TETHER_FD) and `watch_tether` reads it on a daemon
  thread. The launcher never writes, so the read returns only at EOF, which the kernel delivers
  when the last writer is gone: the launcher died, or closed the tether on purpose. The child then
  sends itself SIGTERM (its own clean shutdown frees its port) and SIGKILL after a grace period.
  A descriptor survives exec, so a wrapper such as `ip netns exec` keeps it, and it is process-wide,
  so it does not matter which of the launcher's threads started the child.
* `die_with_parent`: a preexec hook for programs that run none of our Python (redis-server): the
  kernel signals the child when its parent goes (prctl PR_SET_PDEATHSIG, Linux only). The kernel
  counts the *thread* that forked the child as its parent, so a child started from a thread gets
  the signal when that thread ends; the mesh's supervisor thread lives until the mesh stops.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

TETHER_FD_ENV = "TOPHAT_TETHER_FD"
GRACE_S = 5.0  # from SIGTERM to SIGKILL once the launcher is gone: a clean shutdown, or none
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Tether:
    """The launcher's end: hold it while the children should live; `close()` (or dying) releases them."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()  # both non-inheritable: Popen passes the read end on purpose
        self.closed = False

    def child_env(self) -> dict[str, str]:
        """What a child's environment needs so that `start_tethered`'s Popen passes it the read end."""
        if self.closed:
            raise RuntimeError("the tether is closed: a child started now would stop at once")
        return {TETHER_FD_ENV: str(self._read_fd)}

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._write_fd)
            os.close(self._read_fd)


def tether_fds(env: Mapping[str, str]) -> tuple[int, ...]:
    """The descriptors a child started with `env` must inherit (Popen's pass_fds)."""
    fd = env.get(TETHER_FD_ENV)
    return (int(fd),) if fd else ()


def _stop_self(grace_s: float) -> None:
    log.warning("the process that started this one is gone; stopping (SIGKILL in %.0f s)", grace_s)
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait(grace_s)  # still here: the clean shutdown hangs
    os.kill(os.getpid(), signal.SIGKILL)


def watch_tether(env: Mapping[str, str] | None = None, grace_s: float = GRACE_S) -> threading.Thread | None:
    """In the child: stop this process once its launcher's tether reaches EOF. None without a tether."""
    fds = tether_fds(os.environ if env is None else env)
    if not fds:
        return None
    fd = fds[0]

    def watch() -> None:
        try:
            while os.read(fd, 1):  # nobody writes; a byte would be a launcher's bug, not a reason to stop
                pass
        except OSError as exc:  # a bad descriptor: no launcher to follow
            log.warning("cannot watch the launcher's tether (fd %d): %s", fd, exc)
            return
        _stop_self(grace_s)

    thread = threading.Thread(target=watch, name="launcher-tether", daemon=True)
    thread.start()
    return thread


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A Popen `preexec_fn` that has the child get `sig` when the launching thread's process goes; None where
    the platform has no prctl. Resolved here, in the parent: the hook runs between fork and exec."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request was made: nobody will signal
            os.kill(os.getpid(), sig)

    return hook
