"""How far PicoSpec's top-K downlink moves the correction distribution, on real prompts and the real model.

On a rejection the device samples the correction from norm(max(0, p - q)) (paper 004 §3.3). With
`--downlink full` it has the whole target row p; with `topk` only p's K largest values, so p
counts as 0 elsewhere and the residual is approximated. This bench measures the total variation
distance between the two residuals (`separate_rejection.residual_tv_distance`) for several K.

Method (cheap and faithful to what the device computes):
- the text: the unsplit target's greedy continuation of each held-out prompt (`generate_full`);
  the measured positions are its drafted positions (every generated token but the first, which
  the cloud samples after its prefill);
- p_t: the full target over prompt + text in one teacher-forced pass, logits at t-1, through
  `logits_to_probs` at temperature T;
- q_t: the device's draft path exactly as token mode runs it: a `StreamSession` on the device
  model (input submodel -> adapter -> norm/head) prefills the prompt locally, starts on the
  target's first token, and drafts one token at a time with `draft_step` (its q row is the one
  the session keeps for the correction); the drafted token is then overwritten with the target's
  own token (teacher forcing), so the next q is computed on the same prefix as p. The adapter's
  feature input reads its own previous state, as in token mode where no deep state comes down.
The prefixes are the greedy text, not text sampled at temperature T; a sampled text would have
other prefixes but is not needed to see how long p's tail is at temperature T.

Why TV is small and shrinks with K: the top-K residual is the exact residual restricted to the
top-K set S, renormalised, so TV = 1 - r(S) / r(V), the exact residual's mass outside S.

Columns: mean / p90 / max TV over positions; `rej-wtd`: the mean over rejections (each position
weighted by its rejection probability, sum max(0, q - p) = TV(p, q)); `token`: the mean TV of the
emitted token's distribution (rejection probability x residual TV); bytes of one rejection's
downlink (`separate_rejection.downlink_bytes`) against the whole row.

    tophat bench topk-tv --model smollm2 --prompts 8 --positions 32 --out bench-results/topk-tv.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from shared.model.checkpoint import Checkpoint
from shared.specdec.device_session import DeviceModel, DraftConfig
from shared.specdec.reference import generate_full
from shared.specdec.sampling import SamplingParams, logits_to_probs
from shared.specdec.separate_rejection import downlink_bytes, make_payload, residual_tv_distance
from shared.specdec.stream_session import StreamSession

DEFAULT_KS = (1, 5, 10, 20, 50)
DEFAULT_TEMPERATURES = (0.8, 1.0)


@torch.inference_mode()
def measure_prompt(
    checkpoint: Checkpoint,
    device_model: DeviceModel,
    prompt_ids: list[int],
    positions: int,
    temperatures: tuple[float, ...],
    ks: tuple[int, ...],
) -> dict[float, list[dict]]:
    """Per temperature, one record per drafted position: {"tv": {k: distance}, "reject": P(rejection)}."""
    text = generate_full(checkpoint, prompt_ids, positions + 1).token_ids  # greedy: first token + drafts
    sequence = torch.tensor([list(prompt_ids) + text])  # [1, S]
    logits = checkpoint.model(input_ids=sequence).logits[0]  # [S, V]
    records: dict[float, list[dict]] = {}
    for temperature in temperatures:
        params = SamplingParams(temperature=temperature, seed=0)
        session = StreamSession(device_model, list(prompt_ids), params, DraftConfig(), max_new_tokens=len(text) + 1)
        session.prefill_locally()
        session.start_token_mode(text[0])
        rows = []
        for offset in range(1, len(text)):
            position = len(prompt_ids) + offset
            session.draft_step()
            q = session.q_rows[position]  # [V] the draft distribution the device would correct with
            session.seq[position] = text[offset]  # teacher forcing: the next draft reads the target's token
            session.stopped = False  # an EOS the draft sampled is replaced, so drafting may go on
            p = logits_to_probs(logits[position - 1], params)  # [V]
            rows.append(
                {"tv": {k: residual_tv_distance(p, q, k) for k in ks}, "reject": float((q - p).clamp_min(0).sum())}
            )
        records[temperature] = rows
    return records


def summarize(records: list[dict], ks: tuple[int, ...], vocab_size: int, temperature: float) -> list[dict]:
    """One row per K over every measured position."""
    row_for_bytes = torch.zeros(vocab_size)
    full_bytes = downlink_bytes(make_payload(row_for_bytes, 0, "full"))
    rejects = [r["reject"] for r in records]
    out = []
    for k in ks:
        tvs = sorted(r["tv"][k] for r in records)
        weighted = sum(r["reject"] * r["tv"][k] for r in records)
        out.append(
            {
                "temperature": temperature,
                "k": k,
                "positions": len(tvs),
                "mean_tv": statistics.fmean(tvs),
                "p90_tv": tvs[min(len(tvs) - 1, int(0.9 * len(tvs)))],
                "max_tv": tvs[-1],
                "rejection_weighted_tv": weighted / sum(rejects) if sum(rejects) > 0 else 0.0,
                "token_tv": weighted / len(tvs),
                "mean_rejection_probability": statistics.fmean(rejects),
                "bytes_per_rejection": downlink_bytes(make_payload(row_for_bytes, 0, "topk", k)),
                "full_row_bytes": full_bytes,
            }
        )
    return out


def run(
    model: str,
    prompts: int,
    positions: int,
    temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES,
    ks: tuple[int, ...] = DEFAULT_KS,
    adapter: str | None = None,
    split_layers: int = 2,
) -> dict:
    from loadgen.bench_core import bench_prompts
    from shared.model.checkpoint import load_checkpoint
    from shared.runtime import build_device_model
    from tophatctl.models import resolve_model

    if prompts < 1 or positions < 1:
        raise ValueError("--prompts and --positions must be >= 1")
    checkpoint = load_checkpoint(resolve_model(model))
    device_model = build_device_model(checkpoint, split_layers, adapter)
    per_temperature: dict[float, list[dict]] = {t: [] for t in temperatures}
    prompt_list = bench_prompts(checkpoint, prompts)
    for prompt_ids in prompt_list:
        for temperature, rows in measure_prompt(
            checkpoint, device_model, prompt_ids, positions, temperatures, ks
        ).items():
            per_temperature[temperature] += rows
    results = [
        row
        for t in temperatures
        if per_temperature[t]
        for row in summarize(per_temperature[t], ks, checkpoint.vocab_size, t)
    ]
    return {
        "model": model,
        "split_layers": split_layers,
        "prompts": len(prompt_list),
        "positions_per_prompt": positions,
        "vocab_size": checkpoint.vocab_size,
        "results": results,
    }


def format_table(report: dict) -> str:
    lines = [
        f"top-K residual vs exact, model {report['model']} (V = {report['vocab_size']}), "
        f"{report['prompts']} prompts x up to {report['positions_per_prompt']} drafted positions",
        f"{'T':>4s} {'K':>4s} {'n':>5s} {'mean TV':>8s} {'p90 TV':>8s} {'max TV':>8s} {'rej-wtd':>8s} "
        f"{'token':>8s} {'P(rej)':>7s} {'bytes':>6s} {'full row':>9s}",
    ]
    for r in report["results"]:
        lines.append(
            f"{r['temperature']:4.1f} {r['k']:4d} {r['positions']:5d} {r['mean_tv']:8.4f} {r['p90_tv']:8.4f} "
            f"{r['max_tv']:8.4f} {r['rejection_weighted_tv']:8.4f} {r['token_tv']:8.4f} "
            f"{r['mean_rejection_probability']:7.3f} {r['bytes_per_rejection']:6d} {r['full_row_bytes']:9d}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> None:
    report = run(
        args.model,
        args.prompts,
        args.positions,
        tuple(float(t) for t in args.temperatures.split(",")),
        tuple(int(k) for k in args.ks.split(",")),
        args.adapter,
        args.split_layers,
    )
    print(format_table(report))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
