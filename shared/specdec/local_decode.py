"""The `device` endpoint (DiSCo): the device's draft model generates a whole answer by itself.

The draft model is everything the device holds: embeddings + the first m layers + the draft
adapter + norm/head. It needs no cloud. It reads the prompt exactly as the token modes' draft
model does (`StreamSession.prefill_locally`: the adapter's side input over the prompt is zero,
no cloud state being known) and then runs autoregressively, each step feeding the adapter its
own previous state, as `DeviceSession.finish_alone` does after losing the cloud. Its text is the
small model's, not the target's: DiSCo's premise is a device model good enough for the task.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable

import torch

from shared.specdec.device_session import DeviceSession, SessionError
from shared.specdec.sampling import sample_logits


class LocalSession(DeviceSession):
    """One request generated on the device alone; `prefill()` then `step()` until `is_finished`."""

    def prefill(self) -> list[int]:
        """The prompt through the draft model; returns the first token (as a list, like every round)."""
        if self.model.adapter is None:
            raise SessionError("this device has no draft adapter: it cannot generate alone")
        ids = torch.tensor(self.prompt_ids)
        shallow = self.model.input(ids, self.input_cache)  # [P, H]
        hidden = self._run_adapter(self.adapter_cache, shallow, ids, torch.zeros_like(shallow))  # [P, H]
        self._local_hidden = hidden[-1:]  # [1, H]
        return self._sample_next()

    def step(self) -> list[int]:
        """The last emitted token through the draft model; returns the next one."""
        ids = torch.tensor(self.generated[-1:])
        shallow = self.model.input(ids, self.input_cache)  # [1, H]
        self._local_hidden = self._run_adapter(self.adapter_cache, shallow, ids, self._local_hidden)  # [1, H]
        return self._sample_next()

    def _sample_next(self) -> list[int]:
        logits = self.model.output(self._local_hidden)[0]  # [V]
        token = sample_logits(logits, self.params, self.generator)
        return self._emit([token])


async def local_session(
    session: LocalSession, offload: Callable[..., Awaitable[list[int]]]
) -> AsyncGenerator[list[int], None]:
    """The tokens of each step (one per step), computed through `offload` (the device's speed)."""
    try:
        yield await offload(session.prefill)
        while not session.is_finished:
            yield await offload(session.step)
    finally:
        session.free()
