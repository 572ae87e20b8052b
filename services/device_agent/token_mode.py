"""The device's side of the verifier's token mode (token ids on the wire, no privacy): HAT's cloud
baseline decoding one token per round trip, and the verdicts of streamed token drafts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from services.device_agent.cloud_errors import CloudError
from shared.specdec.draft_stream import ChunkVerdict, DraftChunk
from shared.specdec.sampling import SamplingParams
from shared.specdec.separate_rejection import RejectionPayload
from shared.specdec.session_loop import SessionLoop, driven
from shared.wire import schema as wire


class TokenCloud(Protocol):
    """What token_decode needs of a verifier connection (cloud_client.WebSocketCloud)."""

    async def open_token_session(self, session_id: int, params: SamplingParams) -> None: ...

    async def token_prefill(self, session_id: int, token_ids: Sequence[int]) -> int: ...

    async def token_step(self, session_id: int, commit_len: int, token_ids: Sequence[int]) -> int: ...

    async def close(self, session_id: int) -> None: ...


class CloudLoop(SessionLoop):
    """The `cloud` mode's rounds: autoregressive decoding with the whole model in the cloud, [token] per round
    trip. The device only tokenizes and detokenizes; it stops at EOS or `max_new_tokens`, which the cloud does
    not need to know."""

    def __init__(
        self,
        cloud: TokenCloud,
        session_id: int,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_new_tokens: int,
        eos_token_id: int | None,
    ):
        self.cloud, self.session_id, self.prompt_ids, self.params = cloud, session_id, prompt_ids, params
        self.max_new_tokens, self.eos_token_id = max_new_tokens, eos_token_id
        self.generated = 0
        self.last: int | None = None

    @property
    def finished(self) -> bool:
        return self.generated > 0 and (self.generated >= self.max_new_tokens or self.last == self.eos_token_id)

    async def open(self) -> None:
        await self.cloud.open_token_session(self.session_id, self.params)

    async def step(self) -> list[int]:
        if self.last is None:
            token = await self.cloud.token_prefill(self.session_id, self.prompt_ids)
        else:  # the cloud holds prompt + every token but the last, which it has not seen yet
            commit_len = len(self.prompt_ids) + self.generated - 1
            token = await self.cloud.token_step(self.session_id, commit_len, [self.last])
        self.generated += 1
        self.last = token
        return [token]

    async def close(self) -> None:
        await self.cloud.close(self.session_id)


token_decode = driven(CloudLoop)


def chunk_verdict(reply: wire.TokenVerdict, chunk: DraftChunk) -> ChunkVerdict:
    """A TokenVerdict as the stream session reads it; one that does not fit its chunk is a CloudError."""
    if reply.num_accepted > chunk.num_drafts or (reply.rejected and reply.num_accepted == chunk.num_drafts):
        raise CloudError(
            wire.ErrorCode.MALFORMED,
            f"a verdict of {reply.num_accepted} accepted "
            f"(rejected {reply.rejected}) for a chunk of {chunk.num_drafts} drafts",
        )
    payload = None
    if reply.rejected:
        if reply.probs is None:
            payload = RejectionPayload(reply.num_accepted, "token", 0, token=reply.token)
        else:
            assert reply.vocab_size is not None  # TokenVerdict refuses a row (probs) without its vocab_size
            if reply.indices is None:
                payload = RejectionPayload(reply.num_accepted, "full", reply.vocab_size, values=reply.probs)
            else:
                payload = RejectionPayload(
                    reply.num_accepted,
                    "topk",
                    reply.vocab_size,
                    values=reply.probs,
                    indices=torch.tensor(reply.indices, dtype=torch.int32),
                )
    return ChunkVerdict(reply.epoch, reply.num_accepted, None if reply.rejected else reply.token, payload, reply.stale)
