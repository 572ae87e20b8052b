"""`make bench-picospec`: cloud, token-sd, picospec, hat and hat-async side by side, per emulated round trip.

One process holds both ends, each on its own core (torch runs one thread; the device's steps run in a
worker thread, the verifier's in another): the real VerifierServer with the whole target model
(`TOPHAT_VERIFIER_FULL_MODEL`) on a loopback WebSocket, and the device agent's real client whose
frames pass an in-process delay line with the round trip (`--rtt-ms`). Requests run one after
another, so a mode's numbers are its own decode speed, not contention between requests.

Per mode and round trip: decode tokens/s (tokens after the first / time after the first), mean TBT,
TTFT, tokens per verification, bytes up and down per verification (after the prompt), and for the
token modes PicoSpec's expected-time model (eqs. 2, 9) fed with this run's measured T_draft, T_verify,
T_RTT and acceptance: modelled tokens/s beside the measured.

    tophat bench picospec --model smollm2 --rtt-ms 20,50,100 --out bench-results/picospec.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("loadgen.bench_picospec")

MODES = ("cloud", "token-sd", "picospec", "hat", "hat-async")


@dataclass
class ModeStats:
    decode_tokens: int = 0
    decode_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    tbt_s: list[float] = field(default_factory=list)
    rounds: int = 0
    tokens_in_rounds: int = 0
    up_bytes: int = 0
    down_bytes: int = 0
    verdicts: list[tuple[int, int]] = field(default_factory=list)
    draft_s: float = 0.0
    draft_steps: int = 0
    stale_chunks: int = 0
    chunks: int = 0

    def row(self) -> dict:
        rounds = max(1, self.rounds)
        return {
            "tokens_per_s": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
            "mean_tbt_ms": 1e3 * statistics.fmean(self.tbt_s) if self.tbt_s else 0.0,
            "mean_ttft_ms": 1e3 * statistics.fmean(self.ttft_s) if self.ttft_s else 0.0,
            "mean_accept_length": self.tokens_in_rounds / rounds,
            "up_bytes_per_round": self.up_bytes / rounds,
            "down_bytes_per_round": self.down_bytes / rounds,
            "rounds": self.rounds,
            "draft_ms_per_token": 1e3 * self.draft_s / self.draft_steps if self.draft_steps else 0,
            "stale_chunks": self.stale_chunks,
            "chunks": self.chunks,
        }


class Wire:
    """Bytes of WebSocket messages each way, counted after the first token (the prompt's upload excluded)."""

    def __init__(self):
        self.up = self.down = 0
        self.counting = False

    def __call__(self, direction: str, nbytes: int) -> None:
        if self.counting:
            if direction == "up":
                self.up += nbytes
            else:
                self.down += nbytes


async def _one(mode, cloud, model, ids, max_new, session_id, config, wire: Wire, stats: ModeStats, downlink, top_k):
    from services.device_agent.token_mode import token_decode
    from shared.specdec.decode_loop import fixed_chunks, run_session
    from shared.specdec.device_session import DeviceSession, DraftConfig
    from shared.specdec.hat_async import hat_async_session
    from shared.specdec.sampling import SamplingParams
    from shared.specdec.stream_engine import StreamTimings
    from shared.specdec.stream_session import StreamSession
    from shared.specdec.token_stream import token_stream_session

    params, drafting = SamplingParams(), DraftConfig(config["eta"], config["max_draft"])

    async def offload(fn, *args):
        return await asyncio.to_thread(fn, *args)

    timings = StreamTimings()
    session = None
    if mode == "cloud":
        rounds = token_decode(cloud, session_id, ids, params, max_new, model.eos_token_id)
    elif mode == "hat":
        session = DeviceSession(model, ids, params, drafting, max_new)
        rounds = run_session(
            session, cloud, session_id, fixed_chunks(len(ids), 128), offload, parallel_candidates=2, parallel_steps=2
        )
    else:
        session = StreamSession(model, ids, params, drafting, max_new)
        from shared.specdec.stream_engine import stream_config

        stream = stream_config(mode, config["group"], config["window"], config["max_draft"], config["eta_gate"])
        rounds = (
            hat_async_session(session, cloud, session_id, fixed_chunks(len(ids), 128), stream, offload, timings=timings)
            if mode == "hat-async"
            else token_stream_session(session, cloud, session_id, stream, offload, downlink, top_k, timings)
        )
    started = time.perf_counter()
    times: list[float] = []
    wire.counting, up0, down0 = False, wire.up, wire.down
    async for tokens in rounds:
        now = time.perf_counter()
        if not times:
            wire.counting = True
            stats.ttft_s.append(now - started)
        else:
            stats.rounds += 1
            stats.tokens_in_rounds += len(tokens)
            stats.tbt_s.extend([(now - times[-1]) / len(tokens)] * len(tokens))
        times.extend([now] * len(tokens))
    wire.counting = False
    stats.up_bytes += wire.up - up0
    stats.down_bytes += wire.down - down0
    if len(times) > 1:
        stats.decode_tokens += len(times) - 1
        stats.decode_s += times[-1] - times[0]
    stats.stale_chunks += timings.stale_chunks
    stats.chunks += timings.chunks
    if session is not None:
        stats.verdicts += session.verdicts
        stats.draft_s += sum(s for s, _ in session.draft_seconds)
        stats.draft_steps += sum(n for _, n in session.draft_seconds)


def _step_seconds(server) -> tuple[float, float]:
    registry = server.metrics.registry
    return (
        registry.get_sample_value("tophat:verifier_step_seconds_sum") or 0.0,
        registry.get_sample_value("tophat:verifier_step_seconds_count") or 0.0,
    )


async def bench_rtt(checkpoint, model, prompts_ids, rtt_ms, modes, max_new, config, downlink, top_k) -> dict:
    from services.device_agent.cloud_client import WebSocketCloud
    from services.verifier_cloud.server import VerifierServer
    from services.verifier_cloud.settings import Settings
    from services.verifier_cloud.token_mode import TokenModel
    from shared.model.checkpoint import split_fingerprint
    from shared.model.split import MiddleSubmodel
    from shared.net.links import LinkProfile

    m = config["split_layers"]
    settings = Settings(port=0, split_layers=m, model_dir=str(checkpoint.path), full_model=True)
    server = VerifierServer(
        settings,
        MiddleSubmodel(checkpoint, m),
        checkpoint.config.max_position_embeddings,
        checkpoint.hidden_size,
        token_model=TokenModel(checkpoint, m),
    )
    stop, started = asyncio.Event(), asyncio.get_running_loop().create_future()
    task = asyncio.create_task(server.serve_forever(stop, started))
    port = await asyncio.wait_for(started, 60)
    wire = Wire()
    link = LinkProfile(float("inf"), float("inf"), rtt_ms / 2e3) if rtt_ms else None
    cloud = WebSocketCloud(
        f"ws://127.0.0.1:{port}/ws",
        checkpoint.hidden_size,
        link=link,
        on_frame=wire,
        split_layers=m,
        fingerprint=split_fingerprint(checkpoint.path, m),
        request_timeout_s=120,
    )
    results = {}
    try:
        measured_rtt = await cloud.measure_rtt()
        session_id = 1
        for mode in modes:
            stats = ModeStats()
            steps_before = _step_seconds(server)
            for ids in prompts_ids:
                session_id += 1
                await _one(mode, cloud, model, ids, max_new, session_id, config, wire, stats, downlink, top_k)
            step_s, steps = (a - b for a, b in zip(_step_seconds(server), steps_before))
            row = stats.row()
            row.update(
                mode=mode,
                rtt_ms=rtt_ms,
                measured_rtt_ms=1e3 * measured_rtt,
                verify_ms_per_step=1e3 * step_s / steps if steps else 0.0,
            )
            row.update(_modelled(stats, row, measured_rtt, mode))
            results[mode] = row
            log.info("rtt %g ms, %s: %.1f tok/s", rtt_ms, mode, row["tokens_per_s"])
    finally:
        await cloud.close_connection()
        stop.set()
        await asyncio.wait_for(task, 30)
    return results


def _modelled(stats: ModeStats, row: dict, rtt_s: float, mode: str) -> dict:
    """PicoSpec's expected-time model (eqs. 2, 9) from this run's own measurements (token modes only)."""
    if mode not in ("token-sd", "picospec", "hat", "hat-async") or not stats.verdicts:
        return {}
    from shared.specdec.picospec_model import alpha_from_verdicts, predict

    alpha = alpha_from_verdicts(stats.verdicts)
    gamma = max(1, round(statistics.fmean(d for d, _ in stats.verdicts)))
    # a synchronous round ends with the bonus (or correction) token: sync_bonus
    prediction = predict(
        alpha, gamma, row["draft_ms_per_token"] / 1e3, rtt_s, row["verify_ms_per_step"] / 1e3, sync_bonus=True
    )
    modelled = prediction.async_tokens_per_s if mode in ("picospec", "hat-async") else prediction.sync_tokens_per_s
    return {
        "alpha": alpha,
        "gamma": gamma,
        "modelled_tokens_per_s": modelled,
        "modelled_bubble_ms": 1e3 * prediction.bubble_s,
    }


def _speedup(row: dict, modes: dict[str, dict], base: str) -> str:
    """row's tokens/s over base mode's at the same round trip, as a table cell; "-" where base did not run."""
    if base in modes and modes[base]["tokens_per_s"]:
        return f"{row['tokens_per_s'] / modes[base]['tokens_per_s']:.2f}x"
    return "-"


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'rtt':>5s} {'mode':10s} {'tok/s':>6s} {'model':>6s} {'TBT ms':>7s} {'TTFT ms':>8s} {'accept':>6s} "
        f"{'up B/rd':>8s} {'down B/rd':>9s} {'vs token-sd':>11s} {'vs hat':>7s} {'vs cloud':>8s} {'stale':>6s}"
    ]
    by_rtt: dict[float, dict[str, dict]] = {}
    for r in rows:
        by_rtt.setdefault(r["rtt_ms"], {})[r["mode"]] = r
    for rtt, modes in by_rtt.items():
        for mode, r in modes.items():
            model = f"{r['modelled_tokens_per_s']:6.1f}" if "modelled_tokens_per_s" in r else f"{'-':>6s}"
            lines.append(
                f"{rtt:5g} {mode:10s} {r['tokens_per_s']:6.1f} {model} {r['mean_tbt_ms']:7.1f} "
                f"{r['mean_ttft_ms']:8.1f} {r['mean_accept_length']:6.2f} {r['up_bytes_per_round']:8.0f} "
                f"{r['down_bytes_per_round']:9.0f} {_speedup(r, modes, 'token-sd'):>11s} "
                f"{_speedup(r, modes, 'hat'):>7s} {_speedup(r, modes, 'cloud'):>8s} {r['stale_chunks']:6d}"
            )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> None:
    from loadgen.bench_core import bench_prompts
    from shared.model.checkpoint import load_checkpoint
    from shared.runtime import build_device_model
    from tophatctl.models import resolve_model

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # the device's steps and the verifier's each get one core of the two
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    checkpoint = load_checkpoint(resolve_model(args.model))
    model = build_device_model(checkpoint, 2, None)
    prompts_ids = bench_prompts(checkpoint, args.prompts)  # held-out chat prompts (stdlib code for the demo model)
    config = {
        "eta": args.eta,
        "max_draft": args.max_draft,
        "group": args.group,
        "window": args.window,
        "split_layers": 2,
        "eta_gate": not args.no_eta_gate,
    }
    rows: list[dict[str, Any]] = []
    for rtt in [float(x) for x in args.rtt_ms.split(",") if x.strip()]:
        results = asyncio.run(
            bench_rtt(
                checkpoint, model, prompts_ids, rtt, modes, args.max_new_tokens, config, args.downlink, args.top_k
            )
        )
        rows += results.values()
    table = format_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "config": {
                    **config,
                    "model": args.model,
                    "prompts": len(prompts_ids),
                    "max_new_tokens": args.max_new_tokens,
                    "downlink": args.downlink,
                    "top_k": args.top_k,
                },
                "results": rows,
            },
            indent=2,
        )
        + "\n"
    )
    args.out.with_suffix(".txt").write_text(table + "\n")
    print(table)  # noqa: T201 - a benchmark's report
