"""HAT's draft adapter Λ (§3.4): one self-attention block between the device's
first m layers and the LLM's own norm + head.

    draft = H_L ∘ Λ ∘ w_L^m,   Λ(h) = h + Attn(RMSNorm(h))

Λ has the shape of a decoder layer's attention (q/k/v/o projections with the
model's head layout, pre-norm and residual); only Λ is trained. It is
initialised from the first middle layer's attention, which is already a good
guess at what the middle does to shallow states.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from shared.model.checkpoint import Checkpoint
from shared.model.kv_cache import SessionKV
from shared.model.layers import attention_forward, packed_positions, rotary_tables
from shared.model.split import _kv_shape, validate_split

ADAPTER_FILENAME = "draft_adapter.safetensors"


class AdapterError(ValueError):
    """An adapter file that does not fit this model or split."""


class DraftAdapter(torch.nn.Module):
    def __init__(self, checkpoint: Checkpoint, split_layers: int):
        super().__init__()
        validate_split(checkpoint.num_layers, split_layers)
        template = checkpoint.model.model.layers[split_layers]
        self.split_layers = split_layers
        self.input_layernorm = copy.deepcopy(template.input_layernorm)
        self.self_attn = copy.deepcopy(template.self_attn)
        self.rotary_emb = checkpoint.model.model.rotary_emb
        self.num_kv_heads, self.head_dim = _kv_shape(checkpoint.config)
        self.requires_grad_(False)

    def new_cache(self) -> SessionKV:
        return SessionKV(1, self.num_kv_heads, self.head_dim, self.input_layernorm.weight.dtype)

    def randomize(self, seed: int) -> "DraftAdapter":
        """A random (untrained) adapter: speculation still must be lossless with it."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.self_attn.named_parameters():
                scale = 0.0 if name.endswith("bias") else param.shape[-1] ** -0.5
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
        return self

    @torch.inference_mode()
    def forward(self, shallow: torch.Tensor, cache: SessionKV) -> torch.Tensor:
        # shallow: [S, H] -> draft final hidden f_S: [S, H]
        positions = packed_positions([cache], [shallow.shape[0]])
        cos, sin = rotary_tables(self.rotary_emb, positions, shallow)
        attn = attention_forward(
            self.self_attn, self.input_layernorm(shallow), [cache.layer(0)], [shallow.shape[0]], cos, sin
        )
        return shallow + attn

    def forward_training(self, shallow: torch.Tensor) -> torch.Tensor:
        """Cache-free causal pass over a batch of whole sequences, with gradients."""
        # shallow: [B, S, H] -> [B, S, H]
        batch, seq_len, _ = shallow.shape
        attn = self.self_attn
        x = self.input_layernorm(shallow)
        q = attn.q_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)  # [B, Hq, S, D]
        k = attn.k_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        v = attn.v_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(x, torch.arange(seq_len)[None, :])  # [1, S, D]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1]
        )  # [B, Hq, S, D]
        return shallow + attn.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.input_layernorm.parameters()) + list(self.self_attn.parameters())

    def save(self, path: Path, extra_metadata: dict | None = None) -> None:
        tensors = {name: t.detach().contiguous().float() for name, t in self.state_dict().items()}
        metadata = {"split_layers": str(self.split_layers), "format": "tophat-draft-adapter-v1"}
        if extra_metadata:
            metadata["training"] = json.dumps(extra_metadata)
        save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: Path, checkpoint: Checkpoint, split_layers: int) -> "DraftAdapter":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise AdapterError(f"adapter file not found: {path}")
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        trained_m = int(metadata.get("split_layers", -1))
        if trained_m != split_layers:
            raise AdapterError(
                f"{path} was trained for --split-layers {trained_m}, not {split_layers}; "
                "train one for this split (tophat train-adapter) or use --adapter random"
            )
        adapter = cls(checkpoint, split_layers)
        state = load_file(str(path))
        try:
            adapter.load_state_dict({k: v.to(adapter.input_layernorm.weight.dtype) for k, v in state.items()})
        except RuntimeError as exc:
            raise AdapterError(f"{path} does not fit this model: {exc}") from exc
        return adapter
