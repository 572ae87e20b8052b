"""hat-async's rounds: HAT's privacy mode (hidden states only; the device samples and judges each chunk from
the deep states the cloud answers) with PicoSpec's asynchronous pipeline (stream_engine.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import torch

from shared.specdec.decode_loop import Cloud, prefill_on_cloud
from shared.specdec.draft_stream import DraftChunk
from shared.specdec.session_loop import ShieldedOffload, driven, inline, release_session
from shared.specdec.stream_engine import StreamConfig, StreamLoop, StreamTimings
from shared.specdec.stream_session import StreamSession


class HatAsyncLoop(StreamLoop):
    """hat-async: HAT's privacy mode (hidden states only, the device samples and judges) with the asynchronous
    pipeline: the device drafts on past an in-flight verification. The first step prefills the prompt on the
    cloud, chunk by chunk, and samples the first token."""

    def __init__(
        self,
        session: StreamSession,
        cloud: Cloud,
        session_id: int,
        chunk_sizes: Sequence[int],
        config: StreamConfig,
        offload: Callable[..., Awaitable] = inline,
        overlap_prefill: bool = True,
        timings: StreamTimings | None = None,
    ):
        self.shielded = ShieldedOffload(offload)
        super().__init__(session, self._send_rows, config, self.shielded, timings)
        self.cloud, self.session_id = cloud, session_id
        self.chunk_sizes, self.overlap_prefill = chunk_sizes, overlap_prefill
        self.prefilled = False

    @property
    def finished(self) -> bool:
        return self.prefilled and self.session.is_finished

    async def open(self) -> None:
        await self.cloud.open(self.session_id)

    async def step(self) -> list[int] | None:
        if self.prefilled:
            return await super().step()
        deep_last = await prefill_on_cloud(
            self.session, self.cloud, self.session_id, self.chunk_sizes, self.offload, self.overlap_prefill
        )
        first = await self.offload(self.session.on_prefill_result, deep_last)
        self.session.start_hidden_mode()
        self.prefilled = True
        return first

    async def close(self) -> None:
        await super().close()
        await release_session(self.cloud, self.session_id, self.session, self.shielded.last)

    async def _send_rows(self, chunk: DraftChunk, shallow: torch.Tensor | None) -> Awaitable[torch.Tensor]:
        assert shallow is not None  # hidden mode: take_chunk gives every chunk its shallow rows
        # the cloud keeps chunk.start_pos positions (a rejected tail is cut), then appends the chunk
        return await self.cloud.send_verify(self.session_id, chunk.start_pos, shallow)


hat_async_session = driven(HatAsyncLoop)
