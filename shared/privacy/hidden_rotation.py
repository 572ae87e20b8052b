"""A secret rotation of the hidden basis between device and cloud (computational invariance, as in SliceGPT).

The device sends `shallow @ Q^T` instead of `shallow` (Q: a secret orthogonal [H, H]); the cloud's middle
layers are re-parameterised so that on rotated input they compute exactly the rotated output of the
original layers; the device turns the deep states back with `deep_rot @ Q` before its norm and head.

Why it is exact: a pre-norm decoder layer reads the residual stream x only through RMSNorm(x) * g followed
by linear maps, and writes to it only through o_proj / down_proj. RMSNorm without its gain commutes with an
orthogonal Q (rms(x Q^T) = rms(x)), so with row vectors and x~ = x Q^T:

    reads:   W_in' = W_in diag(g) Q^T    (q/k/v_proj after input_layernorm, gate/up_proj after
                                          post_attention_layernorm; their biases are unchanged), gains -> 1
    writes:  W_out' = Q W_out, b' = Q b  (o_proj, down_proj)

so every residual state inside the range is the original one times Q^T. Attention and the MLP's inner
activations are untouched (they live in head / intermediate coordinates, not the residual basis).

What it does not do: a cloud that holds these weights and the public checkpoint can solve for Q
(tophatctl/privacy/rotation_attack.py): the rotation hides the basis only from whoever lacks either.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch

from shared.model.split import LayerRange

_SEED_DOMAIN = b"tophat-hidden-rotation-v1:"
_TAG_DOMAIN = b"tophat-hidden-rotation-tag-v1:"
ORTHOGONALITY_TOLERANCE = 1e-4  # max |Q Q^T - I|: an fp32 Q of a few thousand dims is well inside it


class RotationError(ValueError):
    """A rotation that does not fit (wrong shape, not orthogonal) or layers it cannot be folded into."""


def _secret_bytes(seed: str | int) -> bytes:
    if isinstance(seed, bool) or not isinstance(seed, (str, int)):
        raise RotationError(f"a rotation secret is a str or an int, not {type(seed).__name__}")
    if seed == "":
        raise RotationError("an empty rotation secret (empty means: no rotation)")
    return str(seed).encode()


def secret_rotation(seed: str | int, hidden: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The deployment's secret orthogonal Q [hidden, hidden]: QR of a Gaussian drawn (fp64, CPU) from a generator
    seeded by a hash of the secret, columns sign-fixed so Q is a function of the secret alone (Haar-distributed)."""
    if hidden < 1:
        raise RotationError(f"hidden size must be >= 1, got {hidden}")
    digest = hashlib.sha256(_SEED_DOMAIN + _secret_bytes(seed)).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    gaussian = torch.randn(hidden, hidden, generator=generator, dtype=torch.float64)  # [H, H]
    q, r = torch.linalg.qr(gaussian)
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return (q * signs).to(dtype)  # [H, H]; column j scaled by sign(R_jj)


def rotation_tag(seed: str | int) -> int:
    """A u64 naming the rotation (not revealing Q): XORed into the split fingerprint on both sides, so a device
    and a verifier with different secrets (or one without) are refused at OpenSession instead of decoding noise."""
    return int.from_bytes(hashlib.sha256(_TAG_DOMAIN + _secret_bytes(seed)).digest()[:8], "little")


def check_rotation(q: torch.Tensor, hidden: int) -> None:
    """Raise RotationError unless `q` is an orthogonal [hidden, hidden] matrix (to ORTHOGONALITY_TOLERANCE)."""
    if q.dim() != 2 or tuple(q.shape) != (hidden, hidden):
        raise RotationError(f"rotation must be [{hidden}, {hidden}] for hidden size {hidden}, got {list(q.shape)}")
    q64 = q.detach().to(torch.float64, copy=True).cpu()
    error = (q64 @ q64.T - torch.eye(hidden, dtype=torch.float64)).abs().max().item()
    if not error <= ORTHOGONALITY_TOLERANCE:  # also catches NaN
        raise RotationError(
            f"rotation is not orthogonal: max |Q Q^T - I| = {error:.3g} "
            f"(> {ORTHOGONALITY_TOLERANCE:g}; a 16-bit Q is not precise enough, use fp32/fp64)"
        )


def _plain_rms_norm_gain(norm: torch.nn.Module, hidden: int) -> torch.Tensor:
    """The gain g of an RMSNorm computing x / sqrt(mean(x^2) + eps) * g (fp64 copy); refuses any other norm
    (e.g. Gemma's (1 + g), a LayerNorm with a mean or bias), whose gain would not fold this way."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if weight is None or eps is None or tuple(weight.shape) != (hidden,) or getattr(norm, "bias", None) is not None:
        raise RotationError(f"{type(norm).__name__} is not a plain RMSNorm with a [{hidden}] gain")
    probe = torch.randn(3, hidden, generator=torch.Generator().manual_seed(0), dtype=torch.float32)  # [3, H]
    probe = probe.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        got = norm(probe).float()
        x = probe.float()
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if not torch.allclose(got, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item()):
        raise RotationError(f"{type(norm).__name__} does not compute x / rms(x) * g: its gain cannot be folded")
    return weight.detach().to(torch.float64).cpu()


def _set_weight(linear: torch.nn.Linear, value: torch.Tensor) -> None:
    linear.weight.copy_(value.to(device=linear.weight.device, dtype=linear.weight.dtype))


def _layer_parts(layer: Any):  # an HF decoder layer: its norms, self_attn and mlp are set at run time (untyped)
    try:
        attn, mlp = layer.self_attn, layer.mlp
        reads = {
            layer.input_layernorm: (attn.q_proj, attn.k_proj, attn.v_proj),
            layer.post_attention_layernorm: (mlp.gate_proj, mlp.up_proj),
        }
        return reads, (attn.o_proj, mlp.down_proj)
    except AttributeError as exc:
        raise RotationError(f"{type(layer).__name__} is not a Llama-family decoder layer: {exc}") from None


@torch.no_grad()
def folded_read_weights(layer: torch.nn.Module) -> torch.Tensor:
    """The layer's residual-reading maps with their norm gains folded in, stacked: [W_q; W_k; W_v] diag(g_attn)
    over [W_gate; W_up] diag(g_mlp), fp64 [N, H] (no weight is changed). Of rotated layers it is that of the
    original layers times Q^T: what an attacker holding both solves for Q from."""
    reads, _ = _layer_parts(layer)
    rows = []
    for norm, linears in reads.items():
        gain = _plain_rms_norm_gain(norm, norm.weight.shape[0])  # [H]
        rows += [linear.weight.detach().to(torch.float64).cpu() * gain for linear in linears]  # [out, H] each
    return torch.cat(rows)


@torch.no_grad()
def rotate_layers(layer_range: LayerRange | Iterable[torch.nn.Module], q: torch.Tensor) -> None:
    """Re-parameterise `layer_range`'s decoder layers in place so that, fed x Q^T, they return (their original
    output) Q^T. The module's weights are shared with its checkpoint: load a checkpoint for it alone."""
    layers: list[Any] = list(layer_range.layers if hasattr(layer_range, "layers") else layer_range)
    if not layers:
        raise RotationError("no layers to rotate")
    hidden = layers[0].input_layernorm.weight.shape[0] if hasattr(layers[0], "input_layernorm") else -1
    check_rotation(q, hidden)
    q64 = q.detach().to(torch.float64).cpu()  # [H, H]; the algebra in fp64, each weight cast back once
    for layer in layers:
        reads, writes = _layer_parts(layer)
        gains = {norm: _plain_rms_norm_gain(norm, hidden) for norm in reads}  # check every norm before any write
        for norm, linears in reads.items():
            for linear in linears:
                weight = linear.weight.detach().to(torch.float64).cpu()  # [out, H]
                _set_weight(linear, (weight * gains[norm]) @ q64.T)  # W diag(g) Q^T
            norm.weight.fill_(1.0)
        for linear in writes:
            _set_weight(linear, q64 @ linear.weight.detach().to(torch.float64).cpu())  # [H, in]: Q W
            if linear.bias is not None:
                bias = linear.bias.detach().to(torch.float64).cpu()  # [H]
                linear.bias.copy_((q64 @ bias).to(device=linear.bias.device, dtype=linear.bias.dtype))


def apply_secret_rotation(layer_range: LayerRange, secret: str) -> None:
    """The verifier's load step: re-parameterise its middle layers (or one stage's) for the deployment's secret.
    Q in fp64 here (the weights take one rounding each); the device builds the same Q from the same secret."""
    first: Any = layer_range.layers[0]  # an HF decoder layer: its parts are set at run time (untyped)
    hidden = first.input_layernorm.weight.shape[0]
    rotate_layers(layer_range, secret_rotation(secret, hidden, torch.float64))


def rotated_fingerprint(fingerprint: int, secret: str) -> int:
    """The split fingerprint both sides present at OpenSession: with a rotation, XOR its tag (a mismatch is then
    refused as SPLIT_MISMATCH, not decoded into noise); without one, unchanged."""
    return fingerprint ^ rotation_tag(secret) if secret else fingerprint
