"""Edge SD cost model (paper 001 §II-C, §II-D): FLOPs per forward pass, draft memory, and the
runtime model T(b, F) = c1*F*b + c2 with its least-squares fit.

Symbols (paper -> code):
    J (J_d / J_v)        decoder blocks               ModelShape.layers
    h1 (h_1^d / h_1^v)   hidden size                  ModelShape.hidden
    h2 (h_2^d / h_2^v)   FFN inner size               ModelShape.ffn
    I_m                  padded input length of batch m (max over its tasks)   input_len
    O_m                  max expected output length of batch m                 output_len
    l                    speculation length (draft tokens per step)           spec_len
    L                    expected tokens per verification (eq. 7)             tokens_per_step
    n                    decoding step, 1-based                               step
    i                    draft forward pass within a step, 1-based            draft_pass
    b                    batch size (tasks in the batch)                      batch_size
    F                    FLOPs of one forward pass for ONE task               flops

FLOPs count only matrix multiplications (2*a*b*c for [a,b]x[b,c]), as the paper does. Memory is in
BYTES with the paper's FP16 convention (2 bytes per value): weights J*(8*h1^2 + 4*h1*h2) (eq. 9)
and 4*J*h1 bytes of KV per cached token (K and V, h1 values each, per layer; eq. 10).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

FP16_BYTES = 2


class RuntimeFitError(ValueError):
    """The samples cannot determine T(b, F) = c1*F*b + c2: too few distinct points, non-finite
    values, or a fit in which runtime does not grow with work (c1 <= 0)."""


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer as the paper models it (Fig. 3): `layers` blocks (J), each with
    four h1 x h1 attention matrices and an h1 x h2, h2 x h1 FFN."""

    layers: int
    hidden: int
    ffn: int

    def __post_init__(self) -> None:
        _positive_int("layers", self.layers)
        _positive_int("hidden", self.hidden)
        _positive_int("ffn", self.ffn)

    @property
    def parameters(self) -> int:
        """J*(4*h1^2 + 2*h1*h2): weight count of the decoder blocks (§II-C 1, before eq. 9)."""
        return self.layers * (4 * self.hidden**2 + 2 * self.hidden * self.ffn)

    @property
    def weight_bytes(self) -> int:
        """Eq. 9: Γ_p = J*(8*h1^2 + 4*h1*h2) bytes (FP16)."""
        return FP16_BYTES * self.parameters

    @property
    def kv_bytes_per_token(self) -> int:
        """4*J*h1 bytes: one token's K and V (h1 values each) in every layer, FP16 (eq. 10)."""
        return 2 * FP16_BYTES * self.layers * self.hidden

    def forward_flops(self, new_tokens: float, kv_len: float) -> float:
        """FLOPs of one forward pass of ONE task feeding `new_tokens` tokens on top of a KV cache of
        `kv_len` tokens: 4*J*h1*s*(2*h1 + kv + s + h2) with s = new_tokens.

        This is eq. 11 with kv = 0, s = I_m (prefill) and eq. 12 with s = 1 (one decoded token);
        eqs. 13 and 14 are instances of it. `kv_len` may be fractional because the paper counts the
        KV length with the EXPECTED tokens per step L (eqs. 13-14)."""
        if not new_tokens > 0 or not math.isfinite(new_tokens):
            raise ValueError(f"new_tokens must be > 0, got {new_tokens!r}")
        if not kv_len >= 0 or not math.isfinite(kv_len):
            raise ValueError(f"kv_len must be >= 0, got {kv_len!r}")
        h1, h2 = self.hidden, self.ffn
        return 4.0 * self.layers * h1 * new_tokens * (2 * h1 + kv_len + new_tokens + h2)

    def prefill_flops(self, input_len: int) -> float:
        """Eq. 11: F_1 = J*(8*I*h1^2 + 4*I^2*h1 + 4*I*h1*h2)."""
        _positive_int("input_len", input_len)
        return self.forward_flops(input_len, 0)

    def decode_flops(self, kv_len: float) -> float:
        """Eq. 12: F_2 = J*(8*h1^2 + 4*(I_kv + 1)*h1 + 4*h1*h2) for one token on a KV of I_kv."""
        return self.forward_flops(1, kv_len)


def split_model_shapes(num_layers: int, hidden: int, ffn: int, split_layers: int) -> tuple[ModelShape, ModelShape]:
    """(draft, target) as Edge SD prices them for this project's draft model: the target's first m layers plus
    the adapter's block (J^d = m + 1) against all of the target's layers (the embeddings and head, which the
    paper leaves out of eqs. 9-14, are left out here too)."""
    return ModelShape(split_layers + 1, hidden, ffn), ModelShape(num_layers, hidden, ffn)


def draft_pass_flops(draft: ModelShape, input_len: int, step: int, draft_pass: int, tokens_per_step: float) -> float:
    """Eq. 13: F^d_{i,n,m}, the draft model's FLOPs for forward pass i of step n, per task.

    Step 1, pass 1 is the prefill of the padded input (eq. 11). Otherwise one token on a KV of
    I^{kv,d}_{i,n,m} = I_m + ((n-1)*L - 1) + (i-1): the input, the outputs before the previous
    step's bonus token, and the i-1 drafts of this step."""
    _positive_int("input_len", input_len)
    _positive_int("step", step)
    _positive_int("draft_pass", draft_pass)
    if step == 1 and draft_pass == 1:
        return draft.prefill_flops(input_len)
    kv_len = input_len + ((step - 1) * tokens_per_step - 1) + (draft_pass - 1)
    return draft.decode_flops(kv_len)


def verify_step_flops(target: ModelShape, input_len: int, step: int, spec_len: int, tokens_per_step: float) -> float:
    """Eq. 14: F^v_{n,m}, the verify model's FLOPs at step n, per task.

    Step 1 prefills I_m + l tokens (input plus drafts); later steps feed 1 + l tokens (bonus token
    plus drafts) on a KV of I^{kv,v}_{n,m} = I_m + (n-1)*L - 1."""
    _positive_int("input_len", input_len)
    _positive_int("step", step)
    _positive_int("spec_len", spec_len)
    if step == 1:
        return target.forward_flops(input_len + spec_len, 0)
    kv_len = input_len + (step - 1) * tokens_per_step - 1
    return target.forward_flops(1 + spec_len, kv_len)


def batch_draft_memory(draft: ModelShape, input_lens: Sequence[int], output_lens: Sequence[int]) -> int:
    """Eqs. 9-10: Γ^d_m = Γ_p + sum over the batch's tasks of 4*J*h1*(I_m + O_m), in bytes (FP16).

    Every task is charged the batch's padded input I_m = max(input_lens) and its max output
    O_m = max(output_lens): the KV bound the paper uses for the peak of the batch."""
    if len(input_lens) == 0 or len(input_lens) != len(output_lens):
        raise ValueError("a batch needs one input and one output length per task, at least one task")
    for value in (*input_lens, *output_lens):
        _positive_int("a task length", value)
    tokens_per_task = max(input_lens) + max(output_lens)
    return draft.weight_bytes + len(input_lens) * draft.kv_bytes_per_token * tokens_per_task


@dataclass(frozen=True)
class RuntimeModel:
    """Eq. 17: seconds of one forward pass of a batch of b tasks needing F FLOPs each,
    T(b, F) = c1*F*b + c2 (c1: seconds per FLOP, c2: fixed per-pass seconds; per hardware)."""

    c1: float
    c2: float

    def __post_init__(self) -> None:
        _non_negative("c1", self.c1)
        _non_negative("c2", self.c2)

    def seconds(self, batch_size: int, flops: float) -> float:
        _positive_int("batch_size", batch_size)
        _non_negative("flops", flops)
        return self.c1 * flops * batch_size + self.c2


def fit_runtime(samples: Iterable[tuple[int, float, float]]) -> RuntimeModel:
    """Least-squares fit of eq. 17 to measured passes `(batch_size, flops_per_task, seconds)`.

    The model is linear in x = F*b, so this is a straight-line fit of seconds against x. A
    negative intercept is not a runtime: when the unconstrained fit gives c2 < 0 the constrained
    optimum (c2 >= 0, a convex problem) lies on c2 = 0 and is c1 = sum(x*y)/sum(x^2).
    Raises RuntimeFitError for fewer than 2 distinct x, non-finite input, or c1 <= 0."""
    rows = [(b, f, t) for b, f, t in samples]
    work = np.array([float(b) * float(f) for b, f, _ in rows])
    secs = np.array([float(t) for _, _, t in rows])
    if not (np.all(np.isfinite(work)) and np.all(np.isfinite(secs))):
        raise RuntimeFitError("runtime samples must be finite")
    if any(b <= 0 or f < 0 or t < 0 for b, f, t in rows):
        raise RuntimeFitError("runtime samples need batch_size > 0, flops >= 0, seconds >= 0")
    if len(np.unique(work)) < 2:
        raise RuntimeFitError(f"need at least 2 distinct F*b values to fit c1 and c2, got {len(np.unique(work))}")
    # Scale x so the normal equations are well conditioned (F*b is ~1e9..1e15).
    scale = float(np.max(np.abs(work)))
    design = np.column_stack([work / scale, np.ones_like(work)])
    (slope, intercept), *_ = np.linalg.lstsq(design, secs, rcond=None)
    c1, c2 = float(slope) / scale, float(intercept)
    if c2 < 0:
        c1, c2 = float(np.dot(work, secs) / np.dot(work, work)), 0.0
    if not c1 > 0:
        raise RuntimeFitError(f"fitted c1 = {c1!r}: runtime does not grow with F*b in these samples")
    return RuntimeModel(c1=c1, c2=c2)
