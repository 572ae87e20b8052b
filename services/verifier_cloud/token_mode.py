"""Token mode: the whole model in the cloud, on token ids (HAT §4's "cloud" baseline).

A verifier started with `full_model` also holds what the privacy-mode verifier
must not: the embeddings, layers [0, m), the final norm and the LM head. A
token session then runs embeddings -> layers [0, m) here (`shallow`), shares
the middle submodel's packed pass with every hidden-state session of the
same scheduler step, and goes through norm + head -> sampling (`next_token`).
Layers [0, m) + [m, n) are exactly the model's n layers, so this is the full
model; splitting it at m is what lets token items and hidden-state items
share one packed forward pass of the middle layers instead of two passes.

Sampling uses `shared.specdec.sampling`, with one torch.Generator per session
seeded from the session's seed (unseeded: torch's fixed default seed, as the
device session and the reference decoder do), so a seeded cloud-mode run draws
the same tokens as `shared.specdec.reference.generate_full`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.model.checkpoint import Checkpoint
from shared.model.kv_cache import SessionKV
from shared.model.split import LayerRange, OutputSubmodel, validate_split
from shared.specdec.draft_stream import ChunkVerdict, DraftChunk, StreamVerifier
from shared.specdec.sampling import SamplingParams, logits_to_probs, sample_logits
from shared.specdec.separate_rejection import Downlink
from shared.wire.schema import ErrorCode, WireError

log = logging.getLogger("services.verifier_cloud.token_mode")


@dataclass
class TokenSession:
    """The cloud-side state a token session has beyond its middle-layer KV."""

    lower: SessionKV  # layers [0, m), kept the same length as the session's middle cache
    params: SamplingParams
    generator: torch.Generator
    stream: StreamVerifier = field(default_factory=StreamVerifier)  # streamed drafts (PicoSpec)


@dataclass(frozen=True)
class StreamedChunk:
    """A draft chunk to verify and how to answer a rejection (top_k 0: the whole target row)."""

    chunk: DraftChunk
    top_k: int


class TokenModel:
    """Embeddings + layers [0, m) + norm + head: the parts only token mode needs in the cloud."""

    def __init__(self, checkpoint: Checkpoint, split_layers: int):
        validate_split(checkpoint.num_layers, split_layers)
        embed_tokens = checkpoint.model.get_submodule("model.embed_tokens")
        assert isinstance(embed_tokens, torch.nn.Embedding), "a *ForCausalLM's .model.embed_tokens is an Embedding"
        self.embed_tokens = embed_tokens
        self.lower = LayerRange(checkpoint, 0, split_layers)
        self.output = OutputSubmodel(checkpoint)
        self.vocab_size: int = self.embed_tokens.num_embeddings
        self.dtype = self.lower.dtype
        log.info(
            "token mode on: the cloud holds embeddings, layers [0, %d), norm and head (vocab %d)",
            split_layers,
            self.vocab_size,
        )

    def to(self, device: torch.device | str) -> "TokenModel":
        """Move the embeddings, layers [0, m), norm and head beside the middle layers (dtypes unchanged)."""
        for part in (self.embed_tokens, self.lower, self.output):
            part.to(device)
        return self

    def open(self, params: SamplingParams, capacity: int | None = None) -> TokenSession:
        """A token session; `capacity`: its layers [0, m) in a static cache of that many rows (kv_cache.py)."""
        generator = torch.Generator()
        if params.seed is not None:
            generator.manual_seed(params.seed)
        return TokenSession(self.lower.new_cache(capacity), params, generator)

    def check_ids(self, token_ids: Sequence[int], session_id: int, seq_no: int) -> None:
        """Refuse ids the embedding table does not have (they would fail deep inside a batch)."""
        bad = [t for t in token_ids if t >= self.vocab_size]
        if bad:
            raise WireError(
                ErrorCode.MALFORMED, f"token id {bad[0]} outside the vocabulary ({self.vocab_size})", session_id, seq_no
            )

    @torch.inference_mode()
    def shallow(self, items: Sequence[tuple[SessionKV, torch.Tensor]]) -> list[torch.Tensor]:
        """[(lower cache, ids [S_i])] -> shallow states [[S_i, H]], one packed pass over layers [0, m)."""
        lengths = [ids.shape[0] for _, ids in items]
        ids = torch.cat([ids for _, ids in items]) if len(items) > 1 else items[0][1]
        hidden = self.embed_tokens(ids.to(self.embed_tokens.weight.device))  # [T, H] on the model's device
        out = self.lower.forward_packed(hidden, [cache for cache, _ in items], lengths)
        return list(out.split(lengths))

    @torch.inference_mode()
    def next_token(self, session: TokenSession, deep_last: torch.Tensor) -> int:
        """Sample the token after the last position from its deep state [1, H]."""
        logits = self.output(deep_last)[0]  # [V] fp32
        return sample_logits(logits, session.params, session.generator)

    @torch.inference_mode()
    def verify_chunk(self, session: TokenSession, deep: torch.Tensor, streamed: StreamedChunk) -> ChunkVerdict:
        """The verdict on a streamed draft chunk from the deep states of its tokens [n, H]."""
        p_rows = logits_to_probs(self.output(deep), session.params)  # [n, V]
        downlink: Downlink = "full" if streamed.top_k == 0 else "topk"
        return session.stream.verify(
            streamed.chunk,
            p_rows.cpu(),
            session.generator,
            greedy=session.params.is_greedy,
            downlink=downlink,
            top_k=max(1, streamed.top_k),
        )
