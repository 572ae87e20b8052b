"""The pipeline's stages spawned on this host: one worker process per stage, their startup pipes and
the run's hop token, chained over TCP, watched for an exit and reaped.

The counterpart of remote_stages.py (stages started on their own, wired by address): there is nothing
to spawn or reap for those, so a pipeline of remote stages holds an empty `LocalStages`.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from collections.abc import Callable

from services.verifier_cloud.stages import StageSpec, run_stage, worker_context
from shared.wire.stage_chain import TOKEN_BYTES, chain_stages

ROOT_CAUSE_CHECKS = 20  # x 50 ms: how long a broken hop waits for the stage behind it to be seen dead


class LocalStages:
    """Fresh (not yet started) worker processes, each with a startup pipe and this run's token: one per
    pipeline run, so a restart's hops refuse anything of the old run's."""

    def __init__(self, specs: list[StageSpec], spawn: bool):
        ctx = worker_context()  # spawn, or forked from a fork server that has imported torch once
        self.token = secrets.token_bytes(TOKEN_BYTES)
        # addresses only (stage_chain.chain_stages), never messages
        pipes = [ctx.Pipe() for _ in specs] if spawn else []
        self.startups = [parent_end for parent_end, _ in pipes]
        self.child_ends = [child_end for _, child_end in pipes]
        self.processes = [
            ctx.Process(target=run_stage, args=(spec, child_end, self.token), name=f"verifier-stage-{i}", daemon=True)
            for i, (spec, (_, child_end)) in enumerate(zip(specs, pipes))
        ]

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.processes]

    def start(self) -> None:
        for process in self.processes:
            process.start()
        for child_end in self.child_ends:
            child_end.close()  # the children hold their own copies

    def chain(self, host: str, timeout_s: float) -> tuple[socket.socket, socket.socket]:
        """(hop 0 into stage 0, hop P back from the last stage); StageLinkError if the wiring fails or a
        worker dies meanwhile. Blocking: run it off the event loop."""
        return chain_stages(self.startups, host, self.token, timeout_s, self.dead)

    def dead(self) -> str | None:
        """The first worker that has exited, in words; None while every one runs."""
        for i, process in enumerate(self.processes):
            if not process.is_alive():
                return f"stage {i} worker (pid {process.pid}) exited with code {process.exitcode}"
        return None

    async def root_cause(self, hop_closed: Callable[[], bool], link_failure: str) -> str:
        """A dead stage closes its hops: when a hop broke, name the stage that died if one did. Its
        sockets close as it exits, a moment before the process can be reaped: look for a short while."""
        for _ in range(ROOT_CAUSE_CHECKS):
            if (dead := self.dead()) is not None:
                return dead
            if not hop_closed():
                break  # a refused frame, not a broken hop: no process died for it
            await asyncio.sleep(0.05)
        return link_failure

    def stop(self, grace_s: float) -> None:
        """Wait `grace_s` for each worker to exit, then terminate, then kill it. Blocking: run it off the
        event loop."""
        for process in self.processes:
            if process.pid is None:
                continue
            process.join(grace_s)
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join(2.0)

    def close_pipes(self) -> None:
        for startup in self.startups:
            startup.close()
