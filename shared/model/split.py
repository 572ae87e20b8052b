"""The U-shaped split of a Llama-family model (HAT §2.4).

    device: InputSubmodel  = embeddings + layers[0:m]       -> shallow hidden states
    cloud:  MiddleSubmodel = layers[m:n] (or a sub-range)   -> deep hidden states
    device: OutputSubmodel = final norm + LM head           -> logits

Each submodel keeps one `SessionKV` per session for its own layers. The
submodels hold references to the checkpoint's own modules (no copies), so the
split halves compute exactly what the whole model computes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.model.checkpoint import Checkpoint
from shared.model.kv_cache import SessionKV
from shared.model.layers import run_layers
from shared.model.native_layers import run_native_head
from shared.model.tree_rows import TreeRows

CALIBRATION_ROWS = (1, 4, 16, 64)  # a verify's rows up to a prefill chunk's: where the planners read g


class SplitError(ValueError):
    """A split point or layer range that does not fit the model."""


def kv_shape(config) -> tuple[int, int]:
    """(key/value heads, head dim) of a model config: the shape every KV cache of it is allocated with."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_key_value_heads, head_dim


def validate_split(num_layers: int, split_layers: int) -> None:
    if not 1 <= split_layers <= num_layers - 1:
        raise SplitError(
            f"--split-layers must be between 1 and {num_layers - 1} for a model with {num_layers} layers "
            f"(got {split_layers}); the cloud must keep at least one layer"
        )


class LayerRange(torch.nn.Module):
    """A contiguous range of decoder layers that owns per-session KV caches."""

    def __init__(self, checkpoint: Checkpoint, start: int, stop: int):
        super().__init__()
        if not 0 <= start < stop <= checkpoint.num_layers:
            raise SplitError(f"layer range [{start}, {stop}) outside 0..{checkpoint.num_layers}")
        self.start, self.stop = start, stop
        self.layers = torch.nn.ModuleList(checkpoint.decoder.layers[start:stop])
        self.rotary_emb: torch.nn.Module = checkpoint.decoder.rotary_emb
        self.num_kv_heads, self.head_dim = kv_shape(checkpoint.config)
        self.hidden_size: int = checkpoint.hidden_size
        # PreTrainedModel.dtype; Checkpoint.model is typed as a plain nn.Module, whose __getattr__ says Tensor | Module
        self.dtype: torch.dtype = checkpoint.model.dtype  # type: ignore[assignment]

    @property
    def device(self) -> torch.device:
        """Where the layers' weights are (module.to(device) moves them; KV and inputs follow)."""
        return next(self.layers.parameters()).device

    def new_cache(self, capacity: int | None = None) -> SessionKV:
        """A session's KV for these layers: growable, or static at `capacity` rows (kv_cache.py)."""
        return SessionKV(len(self.layers), self.num_kv_heads, self.head_dim, self.dtype, self.device, capacity)

    @torch.inference_mode()
    def forward_packed(
        self,
        hidden: torch.Tensor,
        caches: Sequence[SessionKV],
        lengths: Sequence[int],
        trees: Sequence[TreeRows | None] | None = None,
    ) -> torch.Tensor:
        # hidden: [T, H] -> [T, H]; trees[i]: session i's new rows as tree nodes, None: causal
        return run_layers(self.layers, self.rotary_emb, hidden, caches, lengths, trees)

    def forward_batch(
        self, items: Sequence[tuple[SessionKV, torch.Tensor]], trees: Sequence[TreeRows | None] | None = None
    ) -> list[torch.Tensor]:
        """One batched pass for many sessions of different lengths: [(cache, hidden [S_i, H])] -> [[S_i, H]]."""
        lengths = [h.shape[0] for _, h in items]
        packed = torch.cat([h for _, h in items]) if len(items) > 1 else items[0][1]
        caches = [c for c, _ in items]
        # no trees: the three-argument call of old (a patched forward_packed may take only those)
        out = (
            self.forward_packed(packed, caches, lengths)
            if trees is None
            else self.forward_packed(packed, caches, lengths, trees)
        )
        return list(out.split(lengths))


def warm_up_layers(layers: LayerRange, hidden_size: int, sizes: Sequence[int] = (256, 8, 1)) -> None:
    """One pass per size on a throwaway cache: first-call costs are paid before any request, and
    the step times reported from then on describe steady state."""
    cache = layers.new_cache()
    try:
        for size in sizes:
            layers.forward_batch([(cache, torch.zeros(size, hidden_size, dtype=layers.dtype, device=layers.device))])
    finally:
        cache.free()


def calibrate_layers(
    layers: LayerRange, hidden_size: int, sizes: Sequence[int] = CALIBRATION_ROWS
) -> list[tuple[int, float]]:
    """(rows, seconds) of one timed pass per size on a throwaway cache, after `warm_up_layers`: the
    verifier's g(mu) before its first request, so the planners answer from a measured curve from the start."""
    cache = layers.new_cache()
    timed = []
    try:
        for size in sizes:
            hidden = torch.zeros(size, hidden_size, dtype=layers.dtype, device=layers.device)
            start = time.perf_counter()
            out = layers.forward_batch([(cache, hidden)])
            out[0].cpu()  # on a GPU the copy waits for the pass, as the runner's replies do
            timed.append((size, time.perf_counter() - start))
            cache.truncate(0)
    finally:
        cache.free()
    return timed


class InputSubmodel(LayerRange):
    """Embeddings + the first m decoder layers; lives on the device."""

    def __init__(self, checkpoint: Checkpoint, split_layers: int):
        validate_split(checkpoint.num_layers, split_layers)
        super().__init__(checkpoint, 0, split_layers)
        self.embed_tokens: torch.nn.Embedding = checkpoint.decoder.embed_tokens

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, cache: SessionKV, tree: TreeRows | None = None) -> torch.Tensor:
        # token_ids: [S] (any device) -> shallow hidden: [S, H] on the layers' device; tree: the S rows as tree nodes
        hidden = self.embed_tokens(token_ids.to(self.embed_tokens.weight.device))
        if tree is None:
            return self.forward_packed(hidden, [cache], [token_ids.shape[0]])
        return self.forward_packed(hidden, [cache], [token_ids.shape[0]], [tree])


class MiddleSubmodel(LayerRange):
    """Layers m..n-1 (or one pipeline stage's sub-range of them); lives in the cloud."""

    def __init__(self, checkpoint: Checkpoint, split_layers: int, stage: tuple[int, int] | None = None):
        validate_split(checkpoint.num_layers, split_layers)
        start, stop = stage if stage is not None else (split_layers, checkpoint.num_layers)
        if start < split_layers:
            raise SplitError(f"middle stage starts at layer {start}, inside the device's first {split_layers}")
        super().__init__(checkpoint, start, stop)


class OutputSubmodel(torch.nn.Module):
    """Final norm + LM head; lives on the device."""

    def __init__(self, checkpoint: Checkpoint):
        super().__init__()
        self.norm: torch.nn.Module = checkpoint.decoder.norm
        # the *ForCausalLM's head, set at run time: nn.Module.__getattr__ types it Tensor | Module
        self.lm_head: torch.nn.Module = checkpoint.model.lm_head  # type: ignore[assignment]

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, H] -> logits: [S, V] fp32 (stable softmax) on the CPU, where sampling's generators live
        native = run_native_head(self.norm, self.lm_head, hidden)  # the same bits, in C++, where it applies
        return native if native is not None else self.lm_head(self.norm(hidden)).float().cpu()


@dataclass
class SplitModel:
    input: InputSubmodel
    middle: MiddleSubmodel
    output: OutputSubmodel

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, split_layers: int) -> "SplitModel":
        return cls(
            InputSubmodel(checkpoint, split_layers),
            MiddleSubmodel(checkpoint, split_layers),
            OutputSubmodel(checkpoint),
        )


def stage_ranges(split_layers: int, num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal layer ranges of the middle submodel for P pipeline stages."""
    middle = num_layers - split_layers
    if not 1 <= num_stages <= middle:
        raise SplitError(f"cannot split {middle} middle layers into {num_stages} stages")
    base, extra = divmod(middle, num_stages)
    ranges, start = [], split_layers
    for stage in range(num_stages):
        stop = start + base + (1 if stage < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges
