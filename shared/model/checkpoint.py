"""Load a local Hugging Face Llama-family checkpoint by path, with clear errors."""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# Config keys that record who saved a checkpoint, not what it computes: two copies of one model may differ in them.
_PROVENANCE_KEYS = frozenset({"transformers_version", "_name_or_path"})
_READ_BYTES = 16 * 1024 * 1024

# Architectures whose decoder layers have the Llama shape this project splits:
# pre-norm RMSNorm, rotary attention (optionally GQA and q/k/v bias), gated MLP.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})


class ModelLoadError(RuntimeError):
    """The directory is missing, is not a checkpoint, or is not a Llama-family model."""


@dataclass
class Checkpoint:
    path: Path
    model: torch.nn.Module  # a *ForCausalLM with .model.{embed_tokens,layers,norm,rotary_emb} and .lm_head
    tokenizer: Any | None  # a transformers tokenizer (untyped here), or None when the checkpoint ships none

    @property
    def config(self) -> Any:
        """The HF config: its fields (num_hidden_layers, hidden_size, ...) are set at run time, untyped."""
        return self.model.config

    @property
    def causal_lm(self) -> Any:
        """The model as transformers runs it: .device, .dtype and generate() are PreTrainedModel's, which
        nn.Module's typing does not know."""
        return self.model

    @property
    def decoder(self) -> Any:
        """The *ForCausalLM's inner *Model (.embed_tokens, .layers, .norm, .rotary_emb): HF sets these parts at
        run time, which nn.Module's typing sees only as Tensor | Module."""
        return self.model.model

    def text_tokenizer(self) -> Any:
        """The tokenizer, for the tools that need text (training data, quality checks): where the checkpoint ships
        none, a ModelLoadError that says so."""
        if self.tokenizer is None:
            raise ModelLoadError(f"{self.path} has no tokenizer")
        return self.tokenizer

    @property
    def lm_head(self) -> Any:
        """The *ForCausalLM's head (a Linear, or the QuantizedLinear that replaced it): set at run time, as decoder."""
        return self.model.lm_head

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        eos = self.config.eos_token_id
        return eos[0] if isinstance(eos, list) else eos


def read_config(path: Path) -> dict:
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json; expected a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file} is not valid JSON: {exc}") from exc
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{path}: model_type {model_type!r} is not a Llama-family model "
            f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
        )
    return config


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32, with_tokenizer: bool = True, quantize: str | None = None
) -> Checkpoint:
    """Load weights (upcast to `dtype`) and the tokenizer if the directory has one.

    quantize: "int8" or "int4" weights for the projections (the LM head: int8), quantized from float32;
    the rest stays float32 (shared/model/quantized.py) and `dtype` is ignored."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    read_config(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32 if quantize else dtype, attn_implementation="sdpa"
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load weights from {path}: {exc}") from exc
    if quantize:
        from shared.model.quantized import quantize_model

        quantize_model(model, quantize)
    model.eval()
    model.requires_grad_(False)
    tokenizer = None
    if with_tokenizer:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:
            log.warning("no usable tokenizer in %s (%s); only --prompt-ids will work", path, exc)
    return Checkpoint(path=path, model=model, tokenizer=tokenizer)


def split_fingerprint(path: str | Path, split_layers: int) -> int:
    """A u64 naming what the two sides of a split at layer m must share: the config and the stored
    weights of the boundary layers m-1 (the device's last) and m (the verifier's first).

    Read from the checkpoint files (safetensors, single or sharded), tensor by tensor, never by
    loading the model: a verifier whose pipeline stages hold the weights has only the config in
    its main process. The same files give the same number on the device and on the verifier; a
    different split point, config or boundary weight gives another one (with odds of 2^-64).
    """
    path = Path(path)
    config = read_config(path)
    digest = hashlib.blake2b(digest_size=8, person=b"tophat-split")
    canonical = {k: v for k, v in config.items() if k not in _PROVENANCE_KEYS}
    digest.update(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode())
    digest.update(struct.pack("<Q", split_layers))
    layers = [i for i in (split_layers - 1, split_layers) if 0 <= i < config.get("num_hidden_layers", 0)]
    prefixes = tuple(f"model.layers.{i}." for i in layers)
    tensors = sorted((name, file) for name, file in _tensor_files(path).items() if name.startswith(prefixes))
    if not layers or not all(any(name.startswith(p) for name, _ in tensors) for p in prefixes):
        raise ModelLoadError(f"{path}: no stored weights for layers {split_layers - 1} and {split_layers}")
    headers: dict[Path, tuple[int, dict]] = {}
    for name, file in tensors:
        if file not in headers:
            headers[file] = _safetensors_header(file)
        data_start, header = headers[file]
        entry = header.get(name)
        if not isinstance(entry, dict) or not isinstance(entry.get("data_offsets"), list):
            raise ModelLoadError(f"{file} does not hold tensor {name} its index names")
        begin, end = entry["data_offsets"]
        digest.update(f"{name}:{entry['dtype']}:{entry['shape']}:".encode())
        with file.open("rb") as f:
            f.seek(data_start + begin)
            remaining = end - begin
            while remaining > 0:
                block = f.read(min(remaining, _READ_BYTES))
                if not block:
                    raise ModelLoadError(f"{file} ends inside tensor {name}")
                digest.update(block)
                remaining -= len(block)
    return int.from_bytes(digest.digest(), "little")


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (model.safetensors, or the shards an index names)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index} is not a safetensors index: {exc}") from exc
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise ModelLoadError(f"{path} has no model.safetensors (the split fingerprint reads safetensors files)")
    return {name: single for name in _safetensors_header(single)[1] if name != "__metadata__"}


def _safetensors_header(file: Path) -> tuple[int, dict]:
    """(offset where tensor data starts, header map) of one safetensors file."""
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read the safetensors header of {file}: {exc}") from exc
    if not isinstance(header, dict):
        raise ModelLoadError(f"{file}: safetensors header is not a map")
    return 8 + length, header
