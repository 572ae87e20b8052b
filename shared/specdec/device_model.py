"""What a device holds for split inference (HAT §3.4): the input submodel, the draft adapter and the
output submodel of one checkpoint, with the shapes a session needs from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from shared.model.adapter import DraftAdapter
from shared.model.checkpoint import Checkpoint
from shared.model.split import InputSubmodel, OutputSubmodel


@dataclass
class DeviceModel:
    """What a device holds: input submodel, draft adapter, output submodel."""

    input: InputSubmodel
    adapter: DraftAdapter | None  # None: no speculation (plain U-shape)
    output: OutputSubmodel
    eos_token_id: int | None
    vocab_size: int
    context_length: int

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, split_layers: int, adapter: DraftAdapter | None) -> "DeviceModel":
        return cls(
            input=InputSubmodel(checkpoint, split_layers),
            adapter=adapter,
            output=OutputSubmodel(checkpoint),
            eos_token_id=checkpoint.eos_token_id,
            vocab_size=checkpoint.vocab_size,
            context_length=checkpoint.config.max_position_embeddings,
        )

    @property
    def hidden_size(self) -> int:
        return cast(int, self.output.lm_head.in_features)  # an int: nn.Module's __getattr__ types it Tensor | Module

    @property
    def device(self) -> torch.device:
        return self.input.device

    @property
    def dtype(self) -> torch.dtype:
        return self.input.dtype

    def to(self, device: torch.device | str) -> "DeviceModel":
        """Move every part to `device`; dtypes stay as the checkpoint was loaded (shared/model/placement.py)."""
        for part in (self.input, self.adapter, self.output):
            if part is not None:
                part.to(device)
        return self

    def compute_states(self, deep: torch.Tensor) -> torch.Tensor:
        """Deep states as the cloud sent them (wire dtype, fp32, CPU) -> this model's device and dtype."""
        return deep.to(device=self.device, dtype=self.dtype)
