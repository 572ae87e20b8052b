"""`make bench-engine`: the model runner against its bandwidth floor, transformers and llama.cpp.

Decode reads every weight once per token, so each figure is printed beside its floor: weight
bytes read per pass / this machine's memory bandwidth (a STREAM-like copy, read + write bytes
counted, best of several, per thread count). Per dtype (f32, bf16, int8), at 1 and 2 threads:
unsplit greedy decode tok/s, a verify pass of the middle layers for 1/4/8/16/32 rows after a
128-token context, and 1 vs 8 concurrent sessions (one packed pass per step). Then the quality table
(loadgen/engine_quality.py): each dtype and llama.cpp's Q4_1 against f32 on held-out text and chat answers,
and the quality gate. Prints the tables and writes JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import time
from pathlib import Path

import torch

from loadgen.bench_core import bench_prompts, decode_rate, load_model, timed_ms, transformers_rate
from loadgen.engine_quality import print_quality, quality_table
from shared.model.checkpoint import Checkpoint
from shared.model.native_layers import python_runner
from shared.model.split import MiddleSubmodel
from tophatctl.models import smollm2_gguf_path

DTYPES = ("f32", "bf16", "int8", "int4")
LLAMA_PYTHON = Path(".venv-llama/bin/python")


def copy_bandwidth(threads: int, mib: int = 512, repeats: int = 6) -> float:
    """Bytes/s of a STREAM copy b[:] = a (read + write counted), the best of `repeats`."""
    torch.set_num_threads(threads)
    a = torch.ones(mib * 2**20 // 4)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - started)
    return 2 * a.nbytes / best


def tensor_bytes(module: torch.nn.Module) -> int:
    return sum(t.nbytes for t in [*module.parameters(), *module.buffers()])


def pass_bytes(checkpoint: Checkpoint, start: int = 0) -> int:
    """Weight bytes one decode pass reads: layers start.. and, for an unsplit pass, the LM head."""
    layers = sum(tensor_bytes(layer) for layer in checkpoint.decoder.layers[start:])
    return layers + (tensor_bytes(checkpoint.lm_head) if start == 0 else 0)


@torch.inference_mode()
def verify_ms(checkpoint: Checkpoint, split: int, rows: int, context: int = 128, repeats: int = 9) -> float:
    """Median ms of one pass of the middle layers over `rows` new rows after a `context`-long prefix, on the
    device the checkpoint's weights are on (synchronized before the clock is read)."""
    middle = MiddleSubmodel(checkpoint, split)
    cache = middle.new_cache()
    hidden, device = checkpoint.hidden_size, middle.device
    middle.forward_batch([(cache, torch.randn(context, hidden, dtype=middle.dtype, device=device))])
    states = torch.randn(rows, hidden, dtype=middle.dtype, device=device)
    ms = timed_ms(
        lambda: middle.forward_batch([(cache, states)]), device, repeats, before=lambda: cache.truncate(context)
    )
    cache.free()
    return ms


BUCKETS = {  # profiler op name -> where the time goes
    "matmul": ("aten::mm", "aten::addmm", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"),
    "kv copies": ("aten::copy_", "aten::index_put_", "aten::index"),
    "masks": ("aten::tril", "aten::ones", "aten::zeros", "aten::fill_", "aten::arange"),
}


@torch.inference_mode()
def profile_breakdown(step, repeats: int = 10) -> dict[str, float]:
    """ms per call of `step` by bucket: each bucket's ops' own CPU time; 'other ops' the rest of the ops;
    'python' the wall time no op accounts for (dispatch, module calls, our own code)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(repeats):
            step()
        wall = time.perf_counter() - started
    spent = {name: 0.0 for name in [*BUCKETS, "other ops"]}
    for event in prof.key_averages():
        bucket = next((b for b, names in BUCKETS.items() if event.key in names), "other ops")
        spent[bucket] += event.self_cpu_time_total / 1e3 / repeats  # us -> ms per call
    spent["python"] = max(0.0, wall * 1e3 / repeats - sum(spent.values()))
    spent["wall (profiled)"] = wall * 1e3 / repeats
    return spent


def profiles(checkpoint: Checkpoint, split: int, adapter: str | None) -> dict[str, dict[str, float]]:
    """The breakdown of a 1-row verify pass of the middle layers (128-token context) and of a device draft step."""
    from shared.runtime import build_device_model
    from shared.specdec.device_session import DeviceSession, DraftConfig

    middle = MiddleSubmodel(checkpoint, split)
    cache = middle.new_cache()
    middle.forward_batch([(cache, torch.randn(128, checkpoint.hidden_size, dtype=middle.dtype))])
    row = torch.randn(1, checkpoint.hidden_size, dtype=middle.dtype)

    def verify() -> None:
        cache.truncate(128)
        middle.forward_batch([(cache, row)])

    device = build_device_model(checkpoint, split, adapter, speculative=True)
    session = DeviceSession(
        device, list(range(100, 228)), draft_config=DraftConfig(eta=0.0, max_draft=1), max_new_tokens=4
    )
    session.prefill_chunk(128)
    session.on_prefill_result(torch.zeros(1, checkpoint.hidden_size))
    session.pending_token = 5
    start = session.commit_len

    def draft_step() -> None:  # one token through the device's layers, the adapter and the head
        session.draft()
        session.input_cache.truncate(start)
        if session.adapter_cache is not None:
            session.adapter_cache.truncate(start)

    return {"verify pass (1 row)": profile_breakdown(verify), "device draft step": profile_breakdown(draft_step)}


def gguf_pass_bytes(path: Path) -> int:
    """Bytes of every tensor in a GGUF: what llama.cpp reads per decoded token (its tied head is the embedding
    table, read whole by the output matmul; the norms are a few KB)."""
    from gguf import GGUFReader

    return sum(int(tensor.n_bytes) for tensor in GGUFReader(str(path)).tensors)


def llama_rate(threads: int, prompt: list[int], new_tokens: int, runs: int) -> float | None:
    if not LLAMA_PYTHON.exists():
        return None
    script = Path(__file__).with_name("llama_cpp_decode.py")
    command = [
        str(LLAMA_PYTHON),
        str(script),
        str(smollm2_gguf_path()),
        "--threads",
        str(threads),
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--new-tokens",
        str(new_tokens),
        "--repeats",
        str(runs + 1),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["tok_s"])


def main(args: argparse.Namespace) -> None:
    threads_list = [int(t) for t in args.threads.split(",")]
    bandwidth = {t: copy_bandwidth(t) for t in threads_list}
    results: dict = {"bandwidth_gb_s": {t: b / 1e9 for t, b in bandwidth.items()}, "runs": []}
    prompts = bench_prompts(load_model(args.model, "f32"), 8)
    prompt = prompts[0]
    for dtype in args.dtypes.split(","):
        checkpoint = load_model(args.model, dtype)
        # "+python": the same weights on the Python runner, the C++ layers switched off (the same bits, slower)
        runner = python_runner() if dtype.endswith("+python") else contextlib.nullcontext()
        with runner:
            unsplit, middle = pass_bytes(checkpoint), pass_bytes(checkpoint, args.split_layers)
            for threads in threads_list:
                torch.set_num_threads(threads)
                bw = bandwidth[threads]
                row: dict = {"dtype": dtype, "threads": threads, "weight_mb": unsplit / 1e6}
                row["decode_tok_s"], tokens = decode_rate(checkpoint, [prompt], args.new_tokens, args.runs)
                row["decode_floor_tok_s"] = bw / unsplit
                row["decode8_tok_s"], _ = decode_rate(checkpoint, prompts[:8], args.new_tokens // 2)
                row["decode8_floor_tok_s"] = 8 * bw / unsplit
                row["verify_ms"] = {k: verify_ms(checkpoint, args.split_layers, k) for k in (1, 4, 8, 16, 32)}
                row["verify_floor_ms"] = middle / bw * 1e3
                if dtype in ("f32", "bf16"):
                    row["transformers_tok_s"] = transformers_rate(checkpoint, [prompt], args.new_tokens)
                results["runs"].append(row)
                print(json.dumps(row), flush=True)
            if dtype in args.profile.split(","):
                torch.set_num_threads(1)
                results.setdefault("profiles", {})[dtype] = profiles(checkpoint, args.split_layers, None)
        del checkpoint
    llama_bytes = gguf_pass_bytes(smollm2_gguf_path())
    for threads in threads_list:
        rate = llama_rate(threads, prompt, args.new_tokens, args.runs)
        results["runs"].append(
            {
                "dtype": "llama.cpp Q4_1",
                "threads": threads,
                "decode_tok_s": rate,
                "weight_mb": llama_bytes / 1e6,
                "decode_floor_tok_s": bandwidth[threads] / llama_bytes,
            }
        )
    if args.quality_positions:
        torch.set_num_threads(max(threads_list))
        engines = {dtype: load_model(args.model, dtype) for dtype in ("f32", "bf16", "int8", "int4")}
        llama = (smollm2_gguf_path(), LLAMA_PYTHON) if LLAMA_PYTHON.exists() and args.model == "smollm2" else None
        results["quality"] = quality_table(
            engines,
            lambda ck, p, n: decode_rate(ck, [p], n, runs=1)[1][0],
            args.quality_positions,
            args.quality_prompts,
            llama=llama,
        )
        del engines
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print_table(results)


def print_table(results: dict) -> None:
    print(
        "\nbandwidth (STREAM copy): "
        + ", ".join(f"{t} thread(s) {b:.1f} GB/s" for t, b in results["bandwidth_gb_s"].items())
    )
    llama_runs = [r for r in results["runs"] if r["dtype"].startswith("llama")]
    llama = {r["threads"]: r["decode_tok_s"] for r in llama_runs}
    print(
        "llama.cpp (Q4_1 GGUF) decode: "
        + ", ".join(
            f"{r['threads']} thread(s) {r['decode_tok_s']:.1f} tok/s, {r['weight_mb']:.0f} MB per token, "
            f"{r['decode_floor_tok_s'] / r['decode_tok_s']:.1f}x its floor of {r['decode_floor_tok_s']:.1f} tok/s"
            if r["decode_tok_s"]
            else f"{r['threads']} thread(s) not installed"
            for r in llama_runs
        )
    )
    print(
        "\n| dtype | threads | weights MB | decode tok/s (floor, x floor, x llama.cpp) | 8 sessions tok/s (floor) "
        "| verify ms 1/4/8/16/32 rows (floor) | transformers tok/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        if r["dtype"].startswith("llama"):
            continue
        versus = f", {r['decode_tok_s'] / llama[r['threads']]:.2f}x" if llama.get(r["threads"]) else ""
        versus = f", {r['decode_floor_tok_s'] / r['decode_tok_s']:.1f}x floor" + versus
        verify = "/".join(f"{ms:.1f}" for ms in r["verify_ms"].values())
        print(
            f"| {r['dtype']} | {r['threads']} | {r['weight_mb']:.0f} | {r['decode_tok_s']:.1f} "
            f"({r['decode_floor_tok_s']:.1f}{versus}) | {r['decode8_tok_s']:.1f} ({r['decode8_floor_tok_s']:.1f}) "
            f"| {verify} ({r['verify_floor_ms']:.1f}) | {r.get('transformers_tok_s', float('nan')):.1f} |"
        )
    for dtype, parts in results.get("profiles", {}).items():
        for what, spent in parts.items():
            print(f"\nprofile, {dtype}, 1 thread, {what}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in spent.items()))
    if results.get("quality"):
        print_quality(results["quality"])
        passing = [
            r
            for r in results["runs"]
            if r["threads"] == 1 and results["quality"].get(r["dtype"], {}).get("passes_gate")
        ]
        if passing:
            best = max(passing, key=lambda r: r["decode_tok_s"])
            print(
                f"\nfastest dtype through the quality gate (1 thread): {best['dtype']}, "
                f"{best['decode_tok_s']:.1f} tok/s"
            )
