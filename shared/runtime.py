"""Assemble the pieces a process needs from a checkpoint directory and options.

Used by the CLI, the device agent and the verifier so they all interpret
`--adapter`, `--split-layers` and prompts the same way.
"""

from __future__ import annotations

from pathlib import Path

from shared.chat import chat_prompt_ids
from shared.model.adapter import ADAPTER_FILENAME, AdapterError, DraftAdapter
from shared.model.checkpoint import Checkpoint
from shared.model.native_build import native_module
from shared.model.quantized import quantize_linears
from shared.specdec.device_session import DeviceModel, SessionError

DEFAULT_SPLIT_LAYERS = 2  # HAT uses m=2 for a 32-layer 7B model; the demo model has 8 layers
RANDOM_ADAPTER = "random"


def load_adapter(checkpoint: Checkpoint, split_layers: int, spec: str | None, seed: int = 0) -> DraftAdapter:
    """spec: a path, 'random' (untrained), or None for the checkpoint's own draft_adapter.safetensors."""
    if spec == RANDOM_ADAPTER:
        return DraftAdapter(checkpoint, split_layers).randomize(seed)
    path = Path(spec) if spec else checkpoint.path / ADAPTER_FILENAME
    if not path.is_file():
        raise AdapterError(
            f"no draft adapter at {path}; train one with `tophat train-adapter --model {checkpoint.path}` "
            "or pass --adapter random"
        )
    return DraftAdapter.load(path, checkpoint, split_layers)


def build_device_model(
    checkpoint: Checkpoint, split_layers: int, adapter_spec: str | None, speculative: bool = True
) -> DeviceModel:
    adapter = load_adapter(checkpoint, split_layers, adapter_spec) if speculative else None
    if adapter is not None and adapter.device.type == "cpu" and native_module():
        # The adapter only proposes tokens (the cloud verifies each one), so drafting needs speed, not its exact
        # float32 weights: in Q8_0 blocks through the int8 kernel it reads a quarter of the bytes per draft step
        quantize_linears(adapter, 8)
    return DeviceModel.from_checkpoint(checkpoint, split_layers, adapter)


def encode_prompt(
    checkpoint: Checkpoint, prompt: str | None, prompt_ids: list[int] | None, messages: list[dict] | None = None
) -> list[int]:
    """Prompt ids from exactly one of: raw text, ids, or chat messages (rendered with the model's template)."""
    if sum(x is not None for x in (prompt, prompt_ids, messages)) != 1:
        raise SessionError("give exactly one of a prompt text, prompt ids or chat messages")
    if prompt_ids is not None:
        bad = [t for t in prompt_ids if not 0 <= t < checkpoint.vocab_size]
        if bad:
            raise SessionError(f"prompt ids out of vocabulary (size {checkpoint.vocab_size}): {bad[:5]}")
        return list(prompt_ids)
    if checkpoint.tokenizer is None:
        raise SessionError(f"{checkpoint.path} has no tokenizer; use --prompt-ids")
    if messages is not None:
        return chat_prompt_ids(checkpoint.tokenizer, messages)
    return checkpoint.tokenizer.encode(prompt, add_special_tokens=False)


def decode_tokens(checkpoint: Checkpoint, token_ids: list[int]) -> str:
    if checkpoint.tokenizer is None:
        return ""
    return checkpoint.tokenizer.decode(token_ids, skip_special_tokens=True)
