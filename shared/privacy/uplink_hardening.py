"""Uplink hardening on the device: `Cloud` wrappers that change what the cloud sees of the hidden states.

`RotatingCloud(cloud, Q)`: sends `shallow @ Q^T`, turns every deep answer back with `deep @ Q`. Against a
verifier whose middle layers were re-parameterised with the same Q (shared/privacy/hidden_rotation.py) the output is
exactly the unsplit model's (greedy: token-identical, up to float rounding of one extra matmul each way).

`NoisyUplink(cloud, sigma, generator)`: adds Gaussian noise of std `sigma * rms(row)` to every hidden-state row
it sends. NOT lossless: the output is then exactly the split model's run on the noisy states, no longer the
original model's (greedy text can differ; sampled tokens follow the noisy model's distribution).

Everything else (fork, rows, token-mode calls, probes, readiness) passes through unchanged: `fork` carries the
rows its caller kept, which already are what this wrapper's caller sent. In the device agent the order is
NoisyUplink(ReplayingCloud(RotatingCloud(WebSocketCloud))): the replay log keeps the noisy rows, so a replayed
session rebuilds the very cache it lost, and the rotation is applied on every send, replays included.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable
from typing import overload

import torch

from shared.privacy.hidden_rotation import check_rotation, secret_rotation
from shared.specdec.verify_layout import VerifyLayout, verify_on


class _Wrapper:
    """Passes every attribute it does not define to the wrapped cloud."""

    def __init__(self, cloud):
        self.inner = cloud

    def __getattr__(self, name: str):
        if name == "inner":  # not yet set (copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    async def open(self, session_id: int) -> None:
        await self.inner.open(session_id)

    async def close(self, session_id: int) -> None:
        await self.inner.close(session_id)


class RotatingCloud(_Wrapper):
    """The device's half of the secret rotation: rotate what goes up, rotate back what comes down."""

    def __init__(self, cloud, q: torch.Tensor):
        super().__init__(cloud)
        check_rotation(q, q.shape[-1] if q.dim() == 2 else -1)
        self.q = q.detach().to(torch.float32).cpu()  # [H, H]; fp32 whatever the model's dtype (exactness)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def _q(self, device: torch.device) -> torch.Tensor:
        if device not in self._on_device:
            self._on_device[device] = self.q.to(device)
        return self._on_device[device]

    def rotate(self, shallow: torch.Tensor) -> torch.Tensor:
        # shallow: [S, H] -> [S, H] in the basis the cloud's layers were re-parameterised for
        return (shallow.float() @ self._q(shallow.device).T).to(shallow.dtype)

    @overload
    def unrotate(self, deep: torch.Tensor) -> torch.Tensor: ...
    @overload
    def unrotate(self, deep: None) -> None: ...
    @overload
    def unrotate(self, deep: torch.Tensor | None) -> torch.Tensor | None: ...

    def unrotate(self, deep: torch.Tensor | None) -> torch.Tensor | None:
        # deep: [S, H] rotated -> [S, H] in the model's own basis (None: a non-final prefill chunk's answer)
        return None if deep is None else (deep.float() @ self._q(deep.device)).to(deep.dtype)

    async def _unrotated(self, answer: Awaitable[torch.Tensor | None]) -> torch.Tensor | None:
        return self.unrotate(await answer)

    async def send_prefill(self, session_id: int, start_pos: int, shallow: torch.Tensor, is_last: bool):
        answer = await self.inner.send_prefill(session_id, start_pos, self.rotate(shallow), is_last)
        return asyncio.ensure_future(self._unrotated(answer))

    async def verify(
        self, session_id: int, commit_len: int, shallow: torch.Tensor, layout: VerifyLayout | None = None
    ) -> torch.Tensor:
        return self.unrotate(await verify_on(self.inner, session_id, commit_len, self.rotate(shallow), layout))

    async def send_verify(self, session_id: int, commit_len: int, shallow: torch.Tensor):
        answer = await self.inner.send_verify(session_id, commit_len, self.rotate(shallow))
        return asyncio.ensure_future(self._unrotated(answer))


class NoisyUplink(_Wrapper):
    """Gaussian noise on every hidden-state row sent: std `sigma` times the row's RMS (a relative scale, so one
    sigma means the same at every depth and for every model). sigma 0 sends the rows unchanged."""

    def __init__(self, cloud, sigma: float, generator: torch.Generator | None = None):
        super().__init__(cloud)
        if not sigma >= 0.0:
            raise ValueError(f"uplink noise sigma must be >= 0, got {sigma}")
        self.sigma = float(sigma)
        # Unpredictable by default: noise the cloud could regenerate would hide nothing.
        self.generator = generator or torch.Generator().manual_seed(secrets.randbits(63))

    def noisy(self, shallow: torch.Tensor) -> torch.Tensor:
        # shallow: [S, H] -> [S, H]
        if self.sigma == 0.0:
            return shallow
        rows = shallow.float()
        rms = rows.pow(2).mean(-1, keepdim=True).sqrt()  # [S, 1]
        noise = torch.randn(rows.shape, generator=self.generator, dtype=torch.float32)  # on the CPU generator
        return (rows + noise.to(rows.device) * (self.sigma * rms)).to(shallow.dtype)

    async def send_prefill(self, session_id: int, start_pos: int, shallow: torch.Tensor, is_last: bool):
        return await self.inner.send_prefill(session_id, start_pos, self.noisy(shallow), is_last)

    async def verify(
        self, session_id: int, commit_len: int, shallow: torch.Tensor, layout: VerifyLayout | None = None
    ) -> torch.Tensor:
        return await verify_on(self.inner, session_id, commit_len, self.noisy(shallow), layout)

    async def send_verify(self, session_id: int, commit_len: int, shallow: torch.Tensor):
        return await self.inner.send_verify(session_id, commit_len, self.noisy(shallow))


def with_rotation(cloud, secret: str, hidden: int):
    """`cloud` behind the secret rotation of `secret` (empty: `cloud` itself)."""
    return RotatingCloud(cloud, secret_rotation(secret, hidden, torch.float32)) if secret else cloud


def with_noise(cloud, sigma: float):
    """`cloud` behind uplink noise of relative std `sigma` (0: `cloud` itself)."""
    return NoisyUplink(cloud, sigma) if sigma > 0 else cloud
