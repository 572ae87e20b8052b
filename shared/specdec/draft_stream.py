"""A draft as a stream of chunks, verified as they arrive (PicoSpec §3.2, and hat-async).

Synchronous speculative decoding sends one draft per round and waits: (pending token,
d_1..d_k) goes up, the verdict (accepted prefix + correction or bonus) comes down. The
asynchronous modes keep drafting while a verification is in flight, so the draft becomes
a stream cut into chunks, each sent as soon as it is drafted:

    chunk = tokens at positions start_pos .. start_pos + n - 1
            the first `num_final` (0 or 1) are final (the first token, a correction or a bonus);
            the others are drafts, each with q(x), the draft model's probability of it
            `more`: the device promises another chunk in the same epoch

The verifying end (the cloud in token mode, the device itself in hat-async, where the cloud
only returns deep states) runs the chunk's tokens through the target and gets p after each of
them (`p_rows[i]`: the target distribution of the token after chunk token i). A draft is
verified with the row before it: inside the chunk, or the last row of the previous chunk
(`carried_row`) for a chunk that continues one which promised more. The accept rule is
`separate_rejection.verify_drafts` (u < p/q, one position after another), so each position
is an ordinary speculative-sampling step conditioned on the accepted prefix: the stream's
output has the target distribution whatever the chunking, and greedy output is the target's
argmax chain.

- all drafts accepted, `more`: no token comes back; the chunk's last row is carried to
  verify the first draft of the next chunk.
- all accepted, not `more`: the bonus token sampled from the last row (it is final; the next
  chunk starts with it).
- a rejection: the epoch goes up, and the verdict carries the correction (greedy) or the
  target row for the device to sample it (top-K or full). Chunks drafted on the rejected
  token are stale: they still carry the old epoch, so the verifier answers them `stale`
  without running them and the device drops them. No stale token reaches the user.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.specdec.separate_rejection import (
    DEFAULT_TOP_K,
    Downlink,
    RejectionPayload,
    SeparateRejectionShapeError,
    verify_drafts,
)


class StreamProtocolError(ValueError):
    """A chunk that does not fit the stream (a continuation with nothing to continue, bad sizes)."""


@dataclass(frozen=True)
class DraftChunk:
    epoch: int
    start_pos: int  # position of tokens[0]
    tokens: tuple[int, ...]
    num_final: int  # leading tokens that are already final (0 or 1); the rest are drafts
    q_drafted: torch.Tensor | None  # [len(tokens) - num_final] q of each draft; None under greedy
    more: bool  # another chunk follows in this epoch (so no bonus when all are accepted)

    def __post_init__(self):
        if not self.tokens:
            raise StreamProtocolError("a chunk holds at least one token")
        if self.num_final not in (0, 1):
            raise StreamProtocolError(f"num_final must be 0 or 1, got {self.num_final}")
        if self.q_drafted is not None and self.q_drafted.shape != (self.num_drafts,):
            raise StreamProtocolError(f"q_drafted must be [{self.num_drafts}], got {list(self.q_drafted.shape)}")

    @property
    def num_drafts(self) -> int:
        return len(self.tokens) - self.num_final

    @property
    def drafts(self) -> tuple[int, ...]:
        return self.tokens[self.num_final :]

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.tokens)


@dataclass(frozen=True)
class ChunkVerdict:
    epoch: int  # the stream's epoch after this verdict (one more than the chunk's after a rejection)
    num_accepted: int  # drafts of the chunk accepted, 0..num_drafts
    token: int | None = None  # the bonus (all accepted, no more)
    rejection: RejectionPayload | None = None  # set exactly when a draft was rejected
    stale: bool = False  # the chunk belonged to an earlier epoch: not run, nothing accepted

    @property
    def rejected(self) -> bool:
        return self.rejection is not None


@dataclass
class StreamVerifier:
    """What the verifying end keeps between one session's chunks."""

    epoch: int = 0
    carried_row: torch.Tensor | None = None  # [V]: p of the next draft, after a chunk that promised more

    def is_stale(self, chunk: DraftChunk) -> bool:
        return chunk.epoch != self.epoch

    def check(self, chunk: DraftChunk) -> None:
        """Refuse a current chunk the stream cannot verify (before any compute is spent on it)."""
        if chunk.num_final == 0 and self.carried_row is None:
            raise StreamProtocolError("a chunk with no final token must continue one that promised more")

    def verify(
        self,
        chunk: DraftChunk,
        p_rows: torch.Tensor,
        generator: torch.Generator | None,
        *,
        greedy: bool,
        downlink: Downlink = "topk",
        top_k: int = DEFAULT_TOP_K,
    ) -> ChunkVerdict:
        """The verdict on one chunk from the target's rows after each of its tokens."""
        # p_rows: [n, V], n = len(chunk.tokens)
        if self.is_stale(chunk):
            return ChunkVerdict(self.epoch, 0, stale=True)
        self.check(chunk)
        if p_rows.dim() != 2 or p_rows.shape[0] != len(chunk.tokens):
            raise StreamProtocolError(f"p_rows must be [{len(chunk.tokens)}, V], got {list(p_rows.shape)}")
        if chunk.q_drafted is None and not greedy and chunk.num_drafts:
            raise StreamProtocolError("sampled verification needs q of every draft")
        # p: [num_drafts + 1, V]: row i verifies draft i, the last row is the bonus position
        if chunk.num_final:
            p = p_rows
        else:
            assert self.carried_row is not None  # check() refused a continuation with nothing carried
            p = torch.cat([self.carried_row[None], p_rows])
        q = chunk.q_drafted if chunk.q_drafted is not None else torch.ones(chunk.num_drafts)
        try:
            verdict = verify_drafts(
                p, list(chunk.drafts), q, generator, greedy=greedy, downlink=downlink, top_k=top_k, bonus=not chunk.more
            )
        except SeparateRejectionShapeError as exc:
            raise StreamProtocolError(str(exc)) from None
        if verdict.rejection is not None:
            self.epoch += 1
            self.carried_row = None
            return ChunkVerdict(self.epoch, verdict.num_accepted, rejection=verdict.rejection)
        self.carried_row = p[-1].clone() if chunk.more else None
        return ChunkVerdict(self.epoch, verdict.num_accepted, token=verdict.bonus_token)
