"""One process of a local mesh: how it was started (so it can be started again the same way) and its log.

The mesh (tophatctl/mesh.py) makes these; the supervisor (tophatctl/supervisor.py) watches them and
restarts the dead with `start_process`, on the same command line, environment and log file.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.processes.lifeline import tether_fds

# Every service runs as `python -m services.<name>` from the repository root.
REPO_ROOT = Path(__file__).resolve().parents[1]
REPLICATED = ("device-agent-", "verifier-cloud-")  # names that end in a replica number


def tethered_command(module: str, prefix: list[str] | None = None) -> list[str]:
    """`python -m module` run so that it stops when its launcher dies (tophatctl/tethered.py)."""
    return [*(prefix or []), sys.executable, "-m", "tophatctl.tethered", module]


def start_process(command: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Start `command` with stdout and stderr appended to `log_path`, in its own session (so a Ctrl-C at the
    operator's terminal reaches the mesh's owner, which stops every process in order). An `env` with a
    launcher's tether (shared/processes/lifeline.py) passes its descriptor on: the session keeps Ctrl-C away, the
    tether still takes the process down with its launcher."""
    with open(log_path, "ab") as handle:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=tether_fds(env),
        )


@dataclass
class ServiceProcess:
    name: str
    process: subprocess.Popen
    ready_url: str
    log_path: Path
    # How it was started, so the supervisor restarts it the same way (netns prefix, env, ports).
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)

    @property
    def role(self) -> str:
        """The service kind: device-agent-3 -> device-agent, verifier-cloud-1 -> verifier-cloud."""
        return self.name.rsplit("-", 1)[0] if self.name.startswith(REPLICATED) else self.name

    def restart(self) -> None:
        """Start the (dead) process again, as it was started: same command, environment and ports."""
        self.process = start_process(self.command, self.env, self.log_path)
        self.started_at = time.monotonic()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
