"""Load a local Hugging Face Llama-family checkpoint by path, with clear errors."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Architectures whose decoder layers have the Llama shape this project splits:
# pre-norm RMSNorm, rotary attention (optionally GQA and q/k/v bias), gated MLP.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})


class ModelLoadError(RuntimeError):
    """The directory is missing, is not a checkpoint, or is not a Llama-family model."""


@dataclass
class Checkpoint:
    path: Path
    model: torch.nn.Module  # a *ForCausalLM with .model.{embed_tokens,layers,norm,rotary_emb} and .lm_head
    tokenizer: object | None  # a transformers tokenizer, or None when the checkpoint ships none

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        eos = self.model.config.eos_token_id
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


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32, with_tokenizer: bool = True) -> Checkpoint:
    """Load weights (upcast to `dtype`) and the tokenizer if the directory has one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    read_config(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load weights from {path}: {exc}") from exc
    model.eval()
    model.requires_grad_(False)
    tokenizer = None
    if with_tokenizer:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:
            log.warning("no usable tokenizer in %s (%s); only --prompt-ids will work", path, exc)
    return Checkpoint(path=path, model=model, tokenizer=tokenizer)
