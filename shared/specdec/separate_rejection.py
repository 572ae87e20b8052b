"""Separate rejection sampling (PicoSpec, paper 004 §3.3), as pure functions.

The speculative accept/reject rule of `sampling.py`, split between the two ends so that
neither ships a whole vocabulary distribution every round:

- uplink (device -> cloud): the drafted token ids and q(x_i), the draft's probability of
  each drafted token only (`uplink_bytes`).
- cloud: accept token i while u_i < p_i(x_i) / q(x_i) (`verify_drafts`); if all k are
  accepted it samples the bonus token from p[k] itself.
- downlink (cloud -> device), only on a rejection: the target distribution at the rejected
  position, either its top-K values + indices (`downlink="topk"`, the paper's sparse
  compression) or the whole row (`downlink="full"`).
- device: samples the correction from norm(max(0, p - q)) with its own full q row
  (`correction_token`).

With "full" the output has exactly the target distribution. With "topk" and K < V the
residual is approximated: p outside the top-K counts as 0, so the residual loses whatever
mass it had there (`residual_tv_distance` measures how much). The top-K values are NOT
renormalised before subtracting q: inside the top-K the approximate residual then equals
the exact one up to a constant, which is the closest the device can get. Greedy is exact
either way: the cloud's argmax is the correction and the payload carries just that token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .sampling import accept_greedy, accepted_prefix_length, residual_distribution, sample

DEFAULT_TOP_K = 10
# On the wire: token ids and top-K indices as int32, probabilities as float32.
TOKEN_ID_BYTES = 4
PROBABILITY_BYTES = 4

Downlink = Literal["topk", "full"]
PayloadKind = Literal["token", "topk", "full"]


class SeparateRejectionShapeError(ValueError):
    """An input to separate rejection sampling has the wrong shape, size or range."""


@dataclass(frozen=True)
class RejectionPayload:
    """What the cloud sends the device at the first rejected position."""

    position: int  # index of the rejected draft token, 0..k-1
    kind: PayloadKind
    vocab_size: int
    token: int | None = None  # kind == "token" (greedy): the correction itself
    values: torch.Tensor | None = None  # "topk": [K] float32, descending; "full": [V] float32
    indices: torch.Tensor | None = None  # "topk": [K] int32 token ids of `values`


@dataclass(frozen=True)
class CloudVerdict:
    num_accepted: int  # draft tokens accepted, 0..k
    bonus_token: int | None  # sampled from p[k] when all k were accepted, else None
    rejection: RejectionPayload | None  # set exactly when num_accepted < k


def make_payload(
    p_row: torch.Tensor, position: int, downlink: Downlink, top_k: int = DEFAULT_TOP_K
) -> RejectionPayload:
    """The downlink message for a rejection at `position` whose target distribution is p_row."""
    # p_row: [V]
    if p_row.dim() != 1:
        raise SeparateRejectionShapeError(f"p_row must be [V], got {list(p_row.shape)}")
    vocab_size = p_row.shape[0]
    if downlink == "full":
        return RejectionPayload(position, "full", vocab_size, values=p_row.float().clone())
    if downlink != "topk":
        raise SeparateRejectionShapeError(f"downlink must be 'topk' or 'full', got {downlink!r}")
    if top_k < 1:
        raise SeparateRejectionShapeError(f"top_k must be >= 1, got {top_k}")
    values, indices = torch.topk(p_row.float(), min(top_k, vocab_size))  # [K], [K]
    return RejectionPayload(position, "topk", vocab_size, values=values, indices=indices.to(torch.int32))


def verify_drafts(
    p: torch.Tensor,
    drafted: list[int],
    q_drafted: torch.Tensor,
    generator: torch.Generator | None,
    *,
    greedy: bool = False,
    downlink: Downlink = "topk",
    top_k: int = DEFAULT_TOP_K,
    bonus: bool = True,
) -> CloudVerdict:
    """Cloud side: accept/reject k drafts knowing only q of each drafted token. With `bonus` False a
    fully accepted draft gets no bonus token (more drafts follow, and p[k] verifies the next of them)."""
    # p: [k+1, V] target probabilities at the draft positions plus the bonus position
    # q_drafted: [k] the draft's probability of each drafted token
    k = len(drafted)
    if p.dim() != 2 or p.shape[0] != k + 1:
        raise SeparateRejectionShapeError(f"p must be [k+1={k + 1}, V], got {list(p.shape)}")
    vocab_size = p.shape[1]
    if any(not 0 <= token < vocab_size for token in drafted):
        raise SeparateRejectionShapeError(f"drafted token outside the vocabulary of {vocab_size}: {drafted}")
    if q_drafted.shape != (k,):
        raise SeparateRejectionShapeError(f"q_drafted must be [k={k}], got {list(q_drafted.shape)}")
    if downlink not in ("topk", "full"):
        raise SeparateRejectionShapeError(f"downlink must be 'topk' or 'full', got {downlink!r}")
    if greedy:
        # Exactly the unsplit argmax rule; the device needs only the correction token.
        verdict = accept_greedy(drafted, p)
        if verdict.num_accepted == k:
            return CloudVerdict(k, verdict.next_token if bonus else None, None)
        payload = RejectionPayload(verdict.num_accepted, "token", vocab_size, token=verdict.next_token)
        return CloudVerdict(verdict.num_accepted, None, payload)
    uniforms = torch.rand(k, generator=generator)  # [k]
    p_of_drafted = p[torch.arange(k), torch.tensor(drafted, dtype=torch.long)].float()  # [k]
    num_accepted = int(accepted_prefix_length(p_of_drafted, q_drafted.float(), uniforms))
    if num_accepted == k:
        return CloudVerdict(k, sample(p[k].float(), generator) if bonus else None, None)
    return CloudVerdict(num_accepted, None, make_payload(p[num_accepted], num_accepted, downlink, top_k))


def dense_target(payload: RejectionPayload) -> torch.Tensor:
    """The target row as the device knows it: exact ("full") or zero outside the top-K ("topk")."""
    # -> [V] float32
    if payload.kind == "full":
        return _values(payload).float()
    if payload.kind == "topk":
        if payload.indices is None:
            raise SeparateRejectionShapeError("a 'topk' payload carries no indices")
        dense = torch.zeros(payload.vocab_size)
        return dense.scatter(0, payload.indices.long(), _values(payload).float())
    raise SeparateRejectionShapeError(f"a {payload.kind!r} payload carries no distribution")


def _values(payload: RejectionPayload) -> torch.Tensor:
    """The probabilities a "topk" or "full" payload carries."""
    if payload.values is None:
        raise SeparateRejectionShapeError(f"a {payload.kind!r} payload carries no values")
    return payload.values


def correction_distribution(payload: RejectionPayload, q_row: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) from what the cloud sent; if it has no mass, p (top-K) normalised."""
    # q_row: [V] the draft's full distribution at the rejected position -> [V], sums to 1
    if q_row.shape != (payload.vocab_size,):
        raise SeparateRejectionShapeError(f"q_row must be [V={payload.vocab_size}], got {list(q_row.shape)}")
    p_known = dense_target(payload)  # [V]
    residual = residual_distribution(p_known, q_row.float())
    # residual_distribution falls back to p itself, which the top-K leaves unnormalised.
    return residual / residual.sum()


def correction_token(payload: RejectionPayload, q_row: torch.Tensor, generator: torch.Generator | None) -> int:
    """Device side: the token that replaces the rejected draft."""
    # q_row: [V]
    if payload.kind == "token":
        if q_row.shape != (payload.vocab_size,):
            raise SeparateRejectionShapeError(f"q_row must be [V={payload.vocab_size}], got {list(q_row.shape)}")
        if payload.token is None:
            raise SeparateRejectionShapeError("a 'token' payload carries no token")
        return int(payload.token)
    return sample(correction_distribution(payload, q_row), generator)


def residual_tv_distance(p_row: torch.Tensor, q_row: torch.Tensor, k: int) -> float:
    """Total variation distance between the exact residual and the one a top-k downlink gives."""
    # p_row, q_row: [V]
    if p_row.dim() != 1 or q_row.shape != p_row.shape:
        raise SeparateRejectionShapeError(
            f"p_row and q_row must both be [V], got {list(p_row.shape)}, {list(q_row.shape)}"
        )
    exact = correction_distribution(make_payload(p_row, 0, "full"), q_row)  # [V]
    approx = correction_distribution(make_payload(p_row, 0, "topk", k), q_row)  # [V]
    return 0.5 * float((exact - approx).abs().sum())


def uplink_bytes(k: int) -> int:
    """Bytes a round's draft takes up: k token ids and k probabilities q(x_i)."""
    if k < 0:
        raise SeparateRejectionShapeError(f"k must be >= 0, got {k}")
    return k * (TOKEN_ID_BYTES + PROBABILITY_BYTES)


def downlink_bytes(payload: RejectionPayload | None) -> int:
    """Bytes of the rejection payload (0 when every draft was accepted); framing not counted."""
    if payload is None:
        return 0
    if payload.kind == "token":
        return TOKEN_ID_BYTES
    if payload.kind == "topk":
        return _values(payload).numel() * (PROBABILITY_BYTES + TOKEN_ID_BYTES)
    return _values(payload).numel() * PROBABILITY_BYTES
