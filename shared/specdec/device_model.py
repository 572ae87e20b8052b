"""What a device holds for split inference (HAT §3.4): the input submodel, the draft adapter and the
output submodel of one checkpoint, with the shapes a session needs from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch

from shared.model.adapter import DraftAdapter
from shared.model.checkpoint import Checkpoint
from shared.model.native_build import native_module
from shared.model.quantized import dequantize, project, quantize_q8
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
    # the draft head over the adapter's draft_vocab: (that vocab tensor, the head's (device, dtype) it came from,
    # weight [N, H], bias [N] or None, scales or None), gathered once from lm_head and rebuilt only when the
    # vocabulary or the head's device/dtype changes
    _draft_head: (
        tuple[torch.Tensor, tuple[torch.device, torch.dtype], torch.Tensor, torch.Tensor | None, torch.Tensor | None]
        | None
    ) = field(default=None, init=False, repr=False, compare=False)

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
        self._draft_head = None
        return self

    def _draft_head_for(self, vocab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The LM head's rows of the draft vocabulary: (weight [N, H], bias [N] or None, int8 scales [N] or None)."""
        weight = cast(torch.Tensor, self.output.lm_head.weight)  # [V, H]: float, or int8 rows (QuantizedLinear)
        cached = self._draft_head
        if cached is None or cached[0] is not vocab or cached[1] != (weight.device, weight.dtype):
            bias = cast(torch.Tensor | None, getattr(self.output.lm_head, "bias", None))  # [V] or None
            index = vocab.to(weight.device)
            sub_bias = bias.detach()[index].clone() if bias is not None else None
            scales = cast(torch.Tensor | None, getattr(self.output.lm_head, "scales", None))  # int8 head: [V]
            sub_scales = scales[index].clone() if scales is not None else None
            sub_weight = weight.detach()[index].clone()  # [N, H]: one gather, kept
            if sub_scales is None and sub_weight.device.type == "cpu" and native_module():
                sub_weight, sub_scales = q8_blocks_if_exact(sub_weight)
            cached = (vocab, (weight.device, weight.dtype), sub_weight, sub_bias, sub_scales)
            self._draft_head = cached
        return cached[2], cached[3], cached[4]

    @torch.inference_mode()
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits to draft from: [S, H] -> [S, V] fp32 on the CPU. Without a draft vocabulary exactly
        `output(hidden)`; with one (FR-Spec) only its N rows of the LM head are computed, and every other
        token gets -inf (softmax 0, never the argmax)."""
        sub, vocab = self._vocab_logits(hidden)  # [S, N]
        if vocab is None:
            return sub
        logits = torch.full((hidden.shape[0], cast(int, self.output.lm_head.out_features)), float("-inf"))  # [S, V]
        logits[:, vocab] = sub
        return logits

    @torch.inference_mode()
    def draft_log_probs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probabilities over the draft vocabulary only, and its token ids: ([S, N] fp32 on the CPU, [N]), or
        over the whole vocabulary ([S, V], None) without one. What `draft_logits` gives, log-softmaxed, with
        the -inf columns left out: a greedy tree level ranks its children here, N columns instead of V."""
        sub, vocab = self._vocab_logits(hidden)
        return torch.log_softmax(sub, dim=-1), vocab

    def _vocab_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # hidden: [S, H] -> ([S, N] fp32 CPU logits of the draft vocabulary, its ids [N]), or ([S, V], None)
        vocab = self.adapter.draft_vocab if self.adapter is not None else None
        if vocab is None:
            return self.output(hidden), None
        weight, bias, scales = self._draft_head_for(vocab)  # [N, H], [N] or None, [N] or None
        return project(self.output.norm(hidden), weight, bias, scales).float().cpu(), vocab  # [S, N]

    def compute_states(self, deep: torch.Tensor) -> torch.Tensor:
        """Deep states as the cloud sent them (wire dtype, fp32, CPU) -> this model's device and dtype."""
        return deep.to(device=self.device, dtype=self.dtype)


def q8_blocks_if_exact(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float head's rows as int8 Q8_0 blocks when that loses nothing (a GGUF model's head is such blocks,
    dequantized): (int8 [N, H], scales) for the int8 kernel, which reads a quarter of f32's bytes per draft
    step; else (the rows as they are, None)."""
    codes, scales = quantize_q8(weight.float())
    if torch.equal(dequantize(codes, scales), weight.float()):
        return codes, scales
    return weight, None
