"""Token mode's rounds (token-sd, picospec): token ids on the wire, the whole target in the cloud.

The device drafts alone with its draft model; the cloud prefills the prompt's ids, samples the first token and
verifies each chunk of drafts (its verdict comes back, stream_engine.py applies it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import torch

from shared.specdec.draft_stream import ChunkVerdict, DraftChunk
from shared.specdec.separate_rejection import DEFAULT_TOP_K, Downlink
from shared.specdec.session_loop import ShieldedOffload, driven, inline, release_session
from shared.specdec.stream_engine import StreamConfig, StreamLoop, StreamTimings
from shared.specdec.stream_session import StreamSession


class TokenCloud(Protocol):
    """What token mode needs from the verifier (token ids on the wire: no privacy)."""

    async def open_token_session(self, session_id: int, params) -> None: ...

    async def token_prefill(self, session_id: int, token_ids: Sequence[int]) -> int: ...

    async def send_token_chunk(
        self, session_id: int, chunk: DraftChunk, downlink: Downlink, top_k: int
    ) -> Awaitable[ChunkVerdict]: ...

    async def close(self, session_id: int) -> None: ...


class TokenStreamLoop(StreamLoop):
    """Token mode (token-sd, picospec): the device drafts alone; the cloud, holding the whole target, prefills
    the prompt's ids, samples the first token and verifies every chunk. The first step is that prefill, with
    the draft model's own prefill beside it."""

    def __init__(
        self,
        session: StreamSession,
        cloud: TokenCloud,
        session_id: int,
        config: StreamConfig,
        offload: Callable[..., Awaitable] = inline,
        downlink: Downlink = "full",
        top_k: int = DEFAULT_TOP_K,
        timings: StreamTimings | None = None,
    ):
        self.shielded = ShieldedOffload(offload)
        super().__init__(session, self._send_chunk, config, self.shielded, timings)
        self.cloud, self.session_id, self.downlink, self.top_k = cloud, session_id, downlink, top_k
        self.prefilled = False

    @property
    def finished(self) -> bool:
        return self.prefilled and self.session.is_finished

    async def open(self) -> None:
        await self.cloud.open_token_session(self.session_id, self.session.params)

    async def step(self) -> list[int] | None:
        if self.prefilled:
            return await super().step()
        first = asyncio.ensure_future(self.cloud.token_prefill(self.session_id, self.session.prompt_ids))
        try:
            await self.offload(self.session.prefill_locally)  # the draft model's prefill, beside the cloud's
        finally:
            if not first.done():
                await asyncio.wait([first])
        self.prefilled = True
        return self.session.start_token_mode(first.result())

    async def close(self) -> None:
        await super().close()
        await release_session(self.cloud, self.session_id, self.session, self.shielded.last)

    async def _send_chunk(self, chunk: DraftChunk, shallow: torch.Tensor | None) -> Awaitable[ChunkVerdict]:
        return await self.cloud.send_token_chunk(self.session_id, chunk, self.downlink, self.top_k)


token_stream_session = driven(TokenStreamLoop)
