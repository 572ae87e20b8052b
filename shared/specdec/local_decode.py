"""The `device` endpoint (DiSCo): the device's draft model generates a whole answer by itself.

The draft model is everything the device holds: embeddings + the first m layers + the draft
adapter + norm/head. It needs no cloud. It reads the prompt exactly as the token modes' draft
model does (`StreamSession.prefill_locally`: the adapter's side input over the prompt is zero,
no cloud state being known) and then runs autoregressively, each step feeding the adapter its
own previous state, as `DeviceSession.finish_alone` does after losing the cloud. Its text is the
small model's, not the target's: DiSCo's premise is a device model good enough for the task.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import torch

from shared.specdec.device_session import DeviceSession, SessionError
from shared.specdec.sampling import sample_logits
from shared.specdec.session_loop import SessionLoop, driven


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


class LocalLoop(SessionLoop):
    """The `device` mode's rounds: the first step prefills the prompt through the draft model, each later step
    makes one token; device compute goes through `offload` (the device's speed)."""

    def __init__(self, session: LocalSession, offload: Callable[..., Awaitable[list[int]]]):
        self.session, self.offload = session, offload
        self.prefilled = False

    @property
    def finished(self) -> bool:
        return self.prefilled and self.session.is_finished

    async def step(self) -> list[int]:
        if self.prefilled:
            return await self.offload(self.session.step)
        self.prefilled = True
        return await self.offload(self.session.prefill)

    async def close(self) -> None:
        self.session.free()


local_session = driven(LocalLoop)
