"""`tophat bench hat`: HAT's adaptive machinery on a real mesh, ratios printed side by side.

Runs on one mesh (real processes, real WebSockets, emulated links) and switches
features per request, so every comparison shares the machine, model, links and
moment:

1. TTFT of long prompts (>= 1k tokens) on a slow link, with prompt chunking (PC)
   vs one upload (HAT Table 5: 0.52x).
2. TBT with SD+PD vs SD alone vs neither (U-shape).
3. Chunk sizes from eq. 3 (the planner) vs fixed 128 / 256: TTFT of the prefilling
   device and TBT of the other devices decoding at the same time.

Prints, never asserts a time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import time
from typing import Any

import httpx

from shared.telemetry import latency_stats
from shared.telemetry.latency_stats import Timeline
from tophatctl.demo_model.corpus import held_out_files
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig
from tophatctl.mesh_ports import find_port_base


def long_prompts(tokenizer, count: int, min_tokens: int, seed: int = 0) -> list[str]:
    """Held-out text cut to just over `min_tokens` tokens each."""
    import random

    held_out = held_out_files()
    rng = random.Random(seed)
    prompts: list[str] = []
    while len(prompts) < count:
        text = rng.choice(held_out).text
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < min_tokens + 10:
            continue
        start = rng.randrange(0, len(ids) - min_tokens)
        prompts.append(tokenizer.decode(ids[start : start + min_tokens + 8]))
    return prompts


def generate(device_url: str, prompt: str, max_new_tokens: int, **switches) -> dict:
    """One request straight to a device agent; returns TTFT, TBT and stats from its own events."""
    body = {"prompt": prompt, "max_new_tokens": max_new_tokens, **switches}
    started = time.perf_counter()
    timeline, stats = Timeline(), {}  # seconds since `started`
    with httpx.stream("POST", f"{device_url}/generate", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line:
                continue
            event = json.loads(line)
            if event["type"] == "tokens":
                timeline.deliver(time.perf_counter() - started, len(event["token_ids"]))
            elif event["type"] == "done":
                stats = event["stats"]
            elif event["type"] == "error":
                raise RuntimeError(event["message"])
    ttft = latency_stats.ttft_s(timeline)
    if ttft is None:
        raise RuntimeError(f"{device_url} streamed no token")
    return {
        "ttft": ttft,
        "tbt": latency_stats.mean_tbt_s(timeline) or 0.0,
        "accept": stats.get("mean_accept_length", 0.0),
    }


def _mean(rows: list[dict], key: str) -> float:
    return statistics.mean(r[key] for r in rows)


def bench_prompt_chunking(mesh: Mesh, prompts: list[str], repeats: int) -> None:
    url = mesh.config.device_url(0)
    rows: dict[str, list[dict]] = {"PC": [], "no PC": []}
    generate(url, prompts[0], 4)  # warm up (and give the planner telemetry)
    for _ in range(repeats):
        for prompt in prompts:
            rows["no PC"].append(generate(url, prompt, 4, prompt_chunking=False))
            rows["PC"].append(generate(url, prompt, 4, prompt_chunking=True))
    pc, no_pc = _mean(rows["PC"], "ttft"), _mean(rows["no PC"], "ttft")
    print(f"\n1. long prompts ({len(prompts)} x {repeats}), link {mesh.config.per_device(mesh.config.link, 0)}:")
    print(f"   TTFT with PC   {pc * 1e3:8.1f} ms")
    print(f"   TTFT without   {no_pc * 1e3:8.1f} ms")
    print(f"   ratio PC / no PC: {pc / no_pc:.2f}x   (HAT Table 5: 0.52x)")


def bench_decoding(mesh: Mesh, prompts: list[str], max_new: int) -> None:
    url = mesh.config.device_url(0)
    modes: dict[str, dict[str, Any]] = {
        "neither (U-shape)": {"speculative": False},
        "SD": {"speculative": True, "parallel_candidates": 0},
        "SD+PD": {"speculative": True},
    }
    rows = {
        name: [generate(url, p, max_new, prompt_chunking=True, **sw) for p in prompts] for name, sw in modes.items()
    }
    base = _mean(rows["neither (U-shape)"], "tbt")
    print(f"\n2. decoding, {len(prompts)} prompts x {max_new} tokens:")
    for name, r in rows.items():
        print(
            f"   {name:18s} TBT {_mean(r, 'tbt') * 1e3:7.2f} ms  accept length {_mean(r, 'accept'):.2f}  "
            f"ratio vs U-shape {_mean(r, 'tbt') / base:.2f}x"
        )


def bench_chunk_sizes(mesh: Mesh, long: list[str], short: list[str], max_new: int) -> None:
    print(f"\n3. one device prefills a long prompt while {mesh.config.num_devices - 1} others decode:")
    info = httpx.get(f"{mesh.config.device_url(0)}/info", timeout=5).json()
    planned = httpx.get(
        f"{mesh.config.planner_url}/chunk-size",
        timeout=5,
        params={"device_id": "device-0", "prompt_tokens": 1024, "bytes_per_token": info["bytes_per_token"]},
    ).json()
    print(f"   planner's answer for device-0, 1024-token prompt: {planned}")
    for label, switches in (
        ("eq. 3 (planner)", {}),
        ("fixed 128", {"chunk_size": 128}),
        ("fixed 256", {"chunk_size": 256}),
    ):
        prefill, decode = [], []
        for prompt in long:
            with concurrent.futures.ThreadPoolExecutor(mesh.config.num_devices) as pool:
                others = [
                    pool.submit(generate, mesh.config.device_url(i), short[i % len(short)], max_new)
                    for i in range(1, mesh.config.num_devices)
                ]
                time.sleep(0.3)  # the others are decoding when the long prompt arrives
                prefill.append(generate(mesh.config.device_url(0), prompt, 4, **switches))
                decode += [f.result() for f in others]
        print(
            f"   {label:16s} TTFT of prefilling device {_mean(prefill, 'ttft') * 1e3:8.1f} ms   "
            f"TBT of decoding devices {_mean(decode, 'tbt') * 1e3:7.2f} ms"
        )


def main(args: argparse.Namespace) -> None:

    from shared.model.checkpoint import load_checkpoint
    from tophatctl.demo_model.corpus import held_out_prompts
    from tophatctl.models import resolve_model

    tokenizer = load_checkpoint(resolve_model(args.model)).tokenizer
    long = long_prompts(tokenizer, 2, args.prompt_tokens)
    short = [p[:200] for p in held_out_prompts(6, seed=3)]
    config = MeshConfig(
        model_dir=args.model,
        adapter=args.adapter,
        num_devices=args.devices,
        port_base=find_port_base(args.devices),
        link=args.link,
        link_mode=args.link_mode,
        auth=False,
    )  # this bench calls the device agents itself, where the streamer would
    with Mesh(config) as mesh:
        mode = "netns + tc" if mesh.netns_links else "in-process shaper"
        print(f"mesh: {args.devices} devices, link {args.link} via {mode}, model {args.model}")
        bench_prompt_chunking(mesh, long, args.repeats)
        bench_decoding(mesh, short[:4], args.max_new_tokens)
        bench_chunk_sizes(mesh, long, short, args.max_new_tokens)
