"""Sampling and the speculative accept/reject rule, as pure functions.

`SamplingParams.temperature == 0` means greedy. For sampling, the rule is the
standard one (Leviathan et al., Chen et al.): accept draft token d with
probability min(1, p(d)/q(d)); on the first rejection resample from
norm(max(0, p - q)); if every draft is accepted, draw a bonus token from p.
Its output has exactly the target distribution p, whatever q is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus sampling mass; 1 = off
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature + top-p applied to logits [..., V]; returns probabilities [..., V] (fp32)."""
    logits = logits.float()
    if params.is_greedy:
        # A one-hot at the argmax: greedy is sampling from this degenerate distribution.
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = torch.where(mass_before < params.top_p, sorted_probs, torch.zeros_like(sorted_probs))
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token from probabilities [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample_logits(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """`sample(logits_to_probs(logits, params), generator)` without building a [V] one-hot when greedy: the
    one-hot's only outcome is the argmax."""
    # logits: [V]
    if params.is_greedy:
        return int(logits.float().argmax(-1))
    return sample(logits_to_probs(logits, params), generator)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); falls back to p when the residual has no mass (p == q)."""
    residual = (p - q).clamp_min(0)
    total = residual.sum()
    return residual / total if total > 0 else p


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # draft tokens accepted, 0..k
    next_token: int  # the correction (on rejection) or bonus (all accepted) token


def accept_greedy(draft_tokens: list[int], target_logits: torch.Tensor) -> Verdict:
    """Longest prefix where the draft equals the target's argmax, plus the target's next token."""
    # target_logits: [k+1, V], row i predicts the token after draft position i-1
    target_tokens = target_logits.argmax(-1).tolist()
    num_accepted = 0
    while num_accepted < len(draft_tokens) and draft_tokens[num_accepted] == target_tokens[num_accepted]:
        num_accepted += 1
    return Verdict(num_accepted, target_tokens[num_accepted])


def accepted_prefix_length(
    p_of_drafted: torch.Tensor, q_of_drafted: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """Number of leading drafts accepted under u_i < p_i(x_i) / q(x_i); batched over leading dims."""
    # p_of_drafted, q_of_drafted, uniforms: [..., k] -> [...] int64
    # u * q < p avoids the division; q == 0 (a token the draft could not have drawn) rejects.
    accepted = (q_of_drafted > 0) & (uniforms * q_of_drafted < p_of_drafted)
    # cumprod turns "accepted at i" into "accepted at every j <= i"; its sum is the prefix length.
    return accepted.long().cumprod(-1).sum(-1)


def accept_sampled(
    draft_tokens: list[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Speculative rejection sampling over one draft."""
    # draft_probs: [k, V] (q, the distributions the drafts were drawn from); target_probs: [k+1, V]
    k = len(draft_tokens)
    uniforms = torch.rand(k, generator=generator)  # [k]
    rows, ids = torch.arange(k), torch.tensor(draft_tokens, dtype=torch.long)
    n = int(accepted_prefix_length(target_probs[rows, ids], draft_probs[rows, ids], uniforms))
    if n < k:
        return Verdict(n, sample(residual_distribution(target_probs[n], draft_probs[n]), generator))
    return Verdict(k, sample(target_probs[k], generator))


def accept(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    if params.is_greedy:
        return accept_greedy(draft_tokens, target_logits)
    if draft_probs is None:
        if draft_tokens:
            raise ValueError("sampled verification needs the draft distributions q")
        draft_probs = target_logits.new_zeros(0, target_logits.shape[-1])
    return accept_sampled(draft_tokens, draft_probs, logits_to_probs(target_logits, params), generator)
