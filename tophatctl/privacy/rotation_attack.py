"""The knowing cloud's attack on the secret rotation (shared/privacy/hidden_rotation.py).

A cloud serving a public checkpoint holds its re-parameterised middle layers. Every residual-reading map of
them is the public one (norm gain folded in) times Q^T: stacked over q/k/v/gate/up of all its layers,
R = M Q^T with M [N, H], N >> H, of full column rank. Least squares solves for Q^T; with exact weights the
recovery is exact up to the dtype's rounding, so against this attacker the rotation hides nothing: its
inverter, trained on the public checkpoint, applies again after `states @ Q_hat`. The rotation only hides the
basis from whoever lacks the public weights or the re-parameterised ones (an eavesdropper on the wire, a
cloud given a private fine-tune).
"""

from __future__ import annotations

import torch

from shared.privacy.hidden_rotation import RotationError, folded_read_weights


def _layers(layer_range) -> list[torch.nn.Module]:
    return list(getattr(layer_range, "layers", layer_range))


@torch.no_grad()
def recover_rotation(public_layers, rotated_layers) -> torch.Tensor:
    """Q_hat [H, H] (fp64) from the same decoder layers, public and re-parameterised (a LayerRange or a sequence
    of layers each): least squares over the stacked gain-folded q/k/v/gate/up weights, R = M Q^T."""
    public, rotated = _layers(public_layers), _layers(rotated_layers)
    if not public or len(public) != len(rotated):
        raise RotationError(f"need the same non-empty layers on both sides, got {len(public)} and {len(rotated)}")
    m = torch.cat([folded_read_weights(layer) for layer in public])  # [N, H]
    r = torch.cat([folded_read_weights(layer) for layer in rotated])  # [N, H]; gains already 1
    if m.shape != r.shape:
        raise RotationError(f"public and rotated weights differ in shape: {list(m.shape)} vs {list(r.shape)}")
    q_transposed = torch.linalg.lstsq(m, r).solution  # [H, H]: argmin ||M X - R||
    return q_transposed.T.contiguous()


def rotation_error(q_hat: torch.Tensor, q: torch.Tensor) -> float:
    """||Q_hat - Q||_F / ||Q||_F (||Q||_F = sqrt(H) for an orthogonal Q)."""
    q64 = q.detach().to(torch.float64).cpu()
    return ((q_hat.detach().to(torch.float64).cpu() - q64).norm() / q64.norm()).item()
