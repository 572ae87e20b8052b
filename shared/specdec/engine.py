"""The decode loop, written once against a `Cloud` so it runs in-process (this
module's `LocalCloud`) or over the network (the device agent's client).

    prefill (chunk by chunk) -> first token -> [draft -> verify -> accept]*
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shared.model.kv_cache import SessionKV
from shared.model.split import LayerRange
from shared.specdec.device_session import DeviceSession


class Cloud(Protocol):
    """What the device needs from the verifier (hidden states only, never tokens)."""

    async def prefill(self, session_id: int, start_pos: int, shallow: torch.Tensor, is_last: bool) -> torch.Tensor | None: ...

    async def verify(self, session_id: int, commit_len: int, shallow: torch.Tensor) -> torch.Tensor: ...

    async def close(self, session_id: int) -> None: ...


class UnknownSessionError(KeyError):
    pass


class LocalCloud:
    """The middle submodel in this process, one KV cache per session."""

    def __init__(self, middle: LayerRange):
        self.middle = middle
        self.caches: dict[int, SessionKV] = {}

    def _cache(self, session_id: int) -> SessionKV:
        try:
            return self.caches[session_id]
        except KeyError:
            raise UnknownSessionError(session_id) from None

    async def prefill(self, session_id, start_pos, shallow, is_last):
        cache = self.caches.setdefault(session_id, self.middle.new_cache())
        if start_pos != cache.length:
            raise ValueError(f"chunk starts at {start_pos} but the session holds {cache.length} positions")
        deep = self.middle.forward_batch([(cache, shallow)])[0]  # [S, H]
        return deep[-1:] if is_last else None

    async def verify(self, session_id, commit_len, shallow):
        cache = self._cache(session_id)
        cache.truncate(commit_len)
        return self.middle.forward_batch([(cache, shallow)])[0]  # [k+1, H]

    async def close(self, session_id):
        cache = self.caches.pop(session_id, None)
        if cache is not None:
            cache.free()


def fixed_chunks(num_tokens: int, chunk_size: int | None) -> list[int]:
    """Chunk sizes covering a prompt: all equal to chunk_size but the last (None = one chunk)."""
    if not chunk_size or chunk_size >= num_tokens:
        return [num_tokens]
    full, rest = divmod(num_tokens, chunk_size)
    return [chunk_size] * full + ([rest] if rest else [])


async def run_session(
    session: DeviceSession, cloud: Cloud, session_id: int, chunk_sizes: Sequence[int]
) -> AsyncIterator[list[int]]:
    """Yield the tokens each round makes final, until the session finishes."""
    try:
        chunks = list(zip(range(len(chunk_sizes)), session.prefill_chunks(chunk_sizes)))
        deep_last = None
        for index, (start, shallow) in chunks:
            deep_last = await cloud.prefill(session_id, start, shallow, is_last=index == len(chunk_sizes) - 1)
        assert deep_last is not None
        yield session.on_prefill_result(deep_last)
        while not session.is_finished:
            draft = session.draft()
            deep = await cloud.verify(session_id, draft.commit_len, draft.shallow)
            yield session.on_verify_result(draft, deep)
    finally:
        await cloud.close(session_id)
        session.free()


@dataclass
class GenerationResult:
    token_ids: list[int]
    accept_lengths: list[int]  # tokens made final per verification round (accepted drafts + 1)
    token_times_s: list[float] = field(default_factory=list)  # time of each token since the request started
    wall_s: float = 0.0

    @property
    def num_rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] if self.token_times_s else 0.0

    @property
    def tbt_s(self) -> float:
        """Mean time between tokens after the first."""
        times = self.token_times_s
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0


async def generate(
    session: DeviceSession, cloud: Cloud, session_id: int = 1, chunk_size: int | None = None
) -> GenerationResult:
    started = time.perf_counter()
    times: list[float] = []
    tokens: list[int] = []
    async for emitted in run_session(session, cloud, session_id, fixed_chunks(len(session.prompt_ids), chunk_size)):
        now = time.perf_counter() - started
        tokens.extend(emitted)
        times.extend([now] * len(emitted))
    return GenerationResult(tokens, list(session.accept_lengths), times, time.perf_counter() - started)
