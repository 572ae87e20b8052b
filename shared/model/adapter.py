"""HAT's draft adapter Λ (§3.4) and two EAGLE-style extensions of it.

    draft = H_L ∘ Λ ∘ w_L^m

    variant "hat":     Λ(h)      = h + Attn(RMSNorm(h))                        (HAT: one attention block)
    variant "fusion":  x = W·[emb(t); h],  Λ = x + Attn(RMSNorm(x))            (EAGLE's input fusion)
    variant "feature": x = W·[h; f_{t-1}], Λ = x + Attn(RMSNorm(x))            (feature-level autoregression)

f_{t-1} is the deep state at the previous position: the cloud's (exact) for verified positions,
the adapter's own prediction while drafting ahead, zeros inside the prompt (the cloud returns the
deep state of the prompt's last position only). `mlp=True` appends the template layer's gated MLP,
making Λ a whole decoder layer. Only Λ is trained. It is initialised from the first middle layer
(attention, MLP) with W passing h through unchanged, a good first guess at what the middle does.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from shared.model.attention import AttentionWeights, PassPlan, attention
from shared.model.checkpoint import Checkpoint
from shared.model.kv_cache import SessionKV
from shared.model.quantized import dequantize_linears
from shared.model.split import kv_shape, validate_split
from shared.model.tree_rows import TreeRows

ADAPTER_FILENAME = "draft_adapter.safetensors"
# its held-out evaluation, beside it: `tophat train-adapter` / `evaluate-adapter` write it, the draft budget reads it
ADAPTER_REPORT_FILENAME = "adapter_report.json"
DRAFT_VOCAB_KEY = "draft_vocab"  # the adapter file's [N] int64 tensor of draft token ids (optional)
VARIANTS = ("hat", "fusion", "feature")


class AdapterError(ValueError):
    """An adapter file that does not fit this model or split."""


@dataclass(frozen=True)
class AdapterSpec:
    variant: str = "hat"
    mlp: bool = False

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise AdapterError(f"adapter variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")

    @property
    def side_input(self) -> str | None:
        """What the adapter reads besides the shallow state: 'embedding', 'feature' or nothing."""
        return {"hat": None, "fusion": "embedding", "feature": "feature"}[self.variant]

    @property
    def name(self) -> str:
        return self.variant + ("+mlp" if self.mlp else "")


class DraftAdapter(torch.nn.Module):
    def __init__(self, checkpoint: Checkpoint, split_layers: int, spec: AdapterSpec = AdapterSpec()):
        super().__init__()
        validate_split(checkpoint.num_layers, split_layers)
        template = checkpoint.decoder.layers[split_layers]
        hidden = checkpoint.hidden_size
        self.split_layers = split_layers
        self.spec = spec
        self.input_layernorm = copy.deepcopy(template.input_layernorm)
        self.self_attn: Any = dequantize_linears(copy.deepcopy(template.self_attn))  # an HF *Attention module
        if spec.mlp:
            self.post_attention_layernorm = copy.deepcopy(template.post_attention_layernorm)
            self.mlp = dequantize_linears(copy.deepcopy(template.mlp))
        if spec.side_input is not None:
            self.fuse = torch.nn.Linear(
                2 * hidden,
                hidden,
                bias=False,
                dtype=checkpoint.model.dtype,
                device=template.input_layernorm.weight.device,
            )  # beside the copies above
            with torch.no_grad():  # start as "pass h through": [side; h] -> h, or [h; f] -> h
                self.fuse.weight.zero_()
                eye = torch.eye(hidden, dtype=self.fuse.weight.dtype, device=self.fuse.weight.device)
                if spec.side_input == "embedding":
                    self.fuse.weight[:, hidden:] = eye
                else:
                    self.fuse.weight[:, :hidden] = eye
        self.rotary_emb: torch.nn.Module = checkpoint.decoder.rotary_emb
        self.num_kv_heads, self.head_dim = kv_shape(checkpoint.config)
        self.vocab_size = checkpoint.vocab_size
        # FR-Spec's truncated draft vocabulary: [N] int64 token ids on the CPU, most frequent first; None: all.
        # A plain attribute, not a buffer: outside the state_dict, saved beside it as "draft_vocab".
        self.draft_vocab: torch.Tensor | None = None
        self.requires_grad_(False)

    def set_draft_vocab(self, ids: torch.Tensor | Sequence[int] | None) -> None:
        """Draft only among these token ids (most frequent first), or among all (None)."""
        if ids is None:
            self.draft_vocab = None
            return
        vocab = torch.as_tensor(ids).detach().cpu()
        if vocab.dim() != 1 or vocab.numel() == 0 or vocab.dtype.is_floating_point or vocab.dtype == torch.bool:
            raise AdapterError(
                f"a draft vocabulary is a non-empty 1-D tensor of token ids, got {vocab.dtype} {tuple(vocab.shape)}"
            )
        vocab = vocab.to(torch.int64)
        if int(vocab.min()) < 0 or int(vocab.max()) >= self.vocab_size:
            raise AdapterError(f"draft vocabulary ids must lie in 0..{self.vocab_size - 1}")
        if vocab.unique().numel() != vocab.numel():
            raise AdapterError("draft vocabulary ids must be unique")
        self.draft_vocab = vocab.clone()

    @property
    def dtype(self) -> torch.dtype:
        return self.input_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.input_layernorm.weight.device

    def new_cache(self) -> SessionKV:
        return SessionKV(1, self.num_kv_heads, self.head_dim, self.dtype, self.device)

    def randomize(self, seed: int) -> "DraftAdapter":
        """A random (untrained) adapter: speculation still must be lossless with it."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if "layernorm" in name:
                    continue
                scale = 0.0 if name.endswith("bias") else param.shape[-1] ** -0.5
                param.copy_(torch.randn(param.shape, generator=generator) * scale)  # CPU draws: same on any device
        return self

    def _fused(self, shallow: torch.Tensor, side: torch.Tensor | None) -> torch.Tensor:
        # shallow, side: [..., H] -> [..., H]
        if self.spec.side_input is None:
            return shallow
        if side is None or side.shape != shallow.shape:
            raise AdapterError(f"the {self.spec.name} adapter needs a side input shaped like {tuple(shallow.shape)}")
        if self.spec.side_input == "feature":
            # deep states carry massive activations (SmolLM2: a few dimensions near 2700, mean 22):
            # read their direction, as the model's own final norm does, not their scale
            side = side * torch.rsqrt(side.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(side.dtype)
        pair = (side, shallow) if self.spec.side_input == "embedding" else (shallow, side)
        return self.fuse(torch.cat(pair, dim=-1))

    def _finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        hidden = x + attn
        if self.spec.mlp:
            hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden

    def forward(
        self,
        shallow: torch.Tensor,
        cache: SessionKV,
        side: torch.Tensor | None = None,
        tree: TreeRows | None = None,
    ) -> torch.Tensor:
        # shallow: [S, H], side: [S, H] (embeddings or previous deep states) -> draft final hidden f_S: [S, H]
        # tree: the S rows as tree nodes (for "feature", side holds each node's parent's deep state)
        if tree is None:
            return self.forward_packed(shallow, [cache], [shallow.shape[0]], side)
        return self.forward_packed(shallow, [cache], [shallow.shape[0]], side, [tree])

    @torch.inference_mode()
    def forward_packed(
        self,
        shallow: torch.Tensor,
        caches: Sequence[SessionKV],
        lengths: Sequence[int],
        side: torch.Tensor | None = None,
        trees: Sequence[TreeRows | None] | None = None,
    ) -> torch.Tensor:
        """Many sessions in one pass (a draft server drafting for many users): each session's rows attend
        to its own cache only, like LayerRange.forward_packed; trees[i]: session i's rows as tree nodes."""
        # shallow: [T, H], side: [T, H] or None, sum(lengths) == T -> [T, H]
        if sum(lengths) != shallow.shape[0]:
            raise AdapterError(f"lengths {list(lengths)} do not add up to {shallow.shape[0]} packed rows")
        x = self._fused(shallow, side)
        plan = PassPlan.build(self.rotary_emb, x, caches, lengths, trees)
        layer_caches = [c.layer(0) for c in caches]
        normed = self.input_layernorm(x)
        attn = attention(AttentionWeights.of_module(self.self_attn), normed, layer_caches, plan)
        return self._finish(x, attn)

    def forward_training(self, shallow: torch.Tensor, side: torch.Tensor | None = None) -> torch.Tensor:
        """Cache-free causal pass over a batch of whole sequences, with gradients."""
        # shallow, side: [B, S, H] -> [B, S, H]
        x_in = self._fused(shallow, side)
        batch, seq_len, _ = x_in.shape
        attn = self.self_attn
        x = self.input_layernorm(x_in)
        q = attn.q_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)  # [B, Hq, S, D]
        k = attn.k_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        v = attn.v_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(x, torch.arange(seq_len, device=x.device)[None, :])  # [1, S, D]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1]
        )  # [B, Hq, S, D]
        return self._finish(x_in, attn.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1)))

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.parameters())

    def save(self, path: Path, extra_metadata: dict | None = None) -> None:
        tensors = {name: t.detach().cpu().contiguous().float() for name, t in self.state_dict().items()}
        if self.draft_vocab is not None:
            tensors[DRAFT_VOCAB_KEY] = self.draft_vocab.contiguous()  # int64: token ids, not weights
        metadata = {
            "split_layers": str(self.split_layers),
            "format": "tophat-draft-adapter-v2",
            "variant": self.spec.variant,
            "mlp": str(self.spec.mlp).lower(),
        }
        if extra_metadata:
            metadata["training"] = json.dumps(extra_metadata)
        save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: Path, checkpoint: Checkpoint, split_layers: int) -> "DraftAdapter":
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise AdapterError(f"adapter file not found: {path}")
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
        except (OSError, SafetensorError) as exc:
            raise AdapterError(f"{path} is not a safetensors adapter file: {exc}") from exc
        trained_m = int(metadata.get("split_layers", -1))
        if trained_m != split_layers:
            raise AdapterError(
                f"{path} was trained for --split-layers {trained_m}, not {split_layers}; "
                "train one for this split (tophat train-adapter) or use --adapter random"
            )
        spec = AdapterSpec(metadata.get("variant", "hat"), metadata.get("mlp", "false") == "true")
        adapter = cls(checkpoint, split_layers, spec)
        state = load_file(str(path))
        vocab = state.pop(DRAFT_VOCAB_KEY, None)
        if vocab is not None:
            try:
                adapter.set_draft_vocab(vocab)
            except AdapterError as exc:
                raise AdapterError(f"{path}: {exc}") from exc
        try:
            adapter.load_state_dict({k: v.to(adapter.dtype) for k, v in state.items()})
        except RuntimeError as exc:
            raise AdapterError(f"{path} does not fit this model: {exc}") from exc
        return adapter
