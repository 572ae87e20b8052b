"""Draft trees against chains, side by side in one run (part of `make bench-core`; printed, never asserted).

For each node budget (0: HAT's chain, stopped by eta) on the same held-out prompts, every budget on a prompt
before the next one, through the in-process middle with an emulated round trip per cloud call: tokens per round
(accept length), the accepted depth histogram, drafting ms per round, decode ms per token; and the verify pass's
cost by node count (the middle once over the tree's rows with tree attention, after a 128-token context).
A cloud-only row is HAT's cloud baseline on the same prompts: the whole model per token, one round trip each.
Greedy outputs are checked token-identical to the chain's, the cloud's included.

    tophat bench trees --model smollm2 --nodes 0,16,32,64 --rtt-ms 50
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from loadgen.bench_core import DelayedCloud, load_bench_models
from shared.model.split import LayerRange, MiddleSubmodel, OutputSubmodel
from shared.model.tree_rows import TreeRows, ancestor_mask_from_parents
from shared.specdec.decode_loop import generate
from shared.specdec.device_session import DeviceSession, DraftConfig


def tree_verify_ms(middle: MiddleSubmodel, hidden_size: int, nodes: int, width: int, repeats: int = 5) -> float:
    """Median ms of one middle pass over a (root + `nodes`)-row tree, `width` children per node, breadth first."""
    cache = middle.new_cache()
    middle.forward_batch([(cache, torch.randn(128, hidden_size))])
    parents = [-1] + [(i - 1) // width for i in range(1, nodes + 1)]
    rows = TreeRows.for_new_tree(128, ancestor_mask_from_parents(parents))
    samples = []
    for _ in range(repeats):
        cache.truncate(128)
        started = time.perf_counter()
        middle.forward_batch([(cache, torch.randn(nodes + 1, hidden_size))], [rows])
        samples.append(time.perf_counter() - started)
    cache.free()
    return statistics.median(samples) * 1e3


@torch.inference_mode()
def cloud_decode(checkpoint, prompts: list[list[int]], max_new_tokens: int, rtt_s: float) -> tuple[float, list]:
    """HAT's cloud baseline in process: ms per decoded token (a round trip, then the whole model over one row
    and the head) and each prompt's greedy tokens, stopped as the sessions stop (max tokens or end of turn)."""
    whole, head = LayerRange(checkpoint, 0, checkpoint.num_layers), OutputSubmodel(checkpoint)
    embed, eos = checkpoint.decoder.embed_tokens, checkpoint.tokenizer.eos_token_id
    decode_s, decoded, outputs = 0.0, 0, []
    for ids in prompts:
        cache = whole.new_cache()
        hidden = whole.forward_packed(embed(torch.tensor(ids)), [cache], [len(ids)])[-1:]  # [1, H]
        tokens = [int(head(hidden)[-1].argmax())]
        while len(tokens) < max_new_tokens and tokens[-1] != eos:
            started = time.perf_counter()
            time.sleep(rtt_s)
            hidden = whole.forward_packed(embed(torch.tensor(tokens[-1:])), [cache], [1])  # [1, H]
            tokens.append(int(head(hidden)[-1].argmax()))
            decode_s += time.perf_counter() - started
            decoded += 1
        cache.free()
        outputs.append(tokens)
    return 1e3 * decode_s / max(decoded, 1), outputs


@dataclass
class ShapeRun:
    """One node budget's rounds over the prompts so far."""

    lengths: list[int] = field(default_factory=list)
    depths: Counter[int] = field(default_factory=Counter)
    draft_s: float = 0.0
    decode_s: float = 0.0
    decoded: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, session: DeviceSession, result) -> None:
        self.outputs.append(result.token_ids)
        self.lengths += result.accept_lengths
        self.depths.update(accepted for _, accepted in session.verdicts)
        self.draft_s += sum(seconds for seconds, _ in session.draft_seconds)
        self.decode_s += result.wall_s - result.ttft_s
        self.decoded += len(result.token_ids) - 1


def compare_budgets(checkpoint, device, middle, prompts, budgets, args) -> dict:
    runs = {nodes: ShapeRun() for nodes in budgets}
    for index, ids in enumerate(prompts):
        # every shape on this prompt before the next prompt, first shape rotated per prompt: a drift in this
        # machine's load falls on every shape alike, not on whichever shape ran in a slow minute
        turn = index % len(budgets)
        for nodes in budgets[turn:] + budgets[:turn]:
            config = DraftConfig(args.eta, args.max_draft, nodes, args.tree_width, args.tree_min_prob)
            session = DeviceSession(device, ids, draft_config=config, max_new_tokens=args.max_new_tokens)
            result = asyncio.run(generate(session, DelayedCloud(middle, args.rtt_ms / 1e3), session_id=index + 1))
            runs[nodes].add(session, result)
    chain_tokens = runs[budgets[0]].outputs
    rows: dict = {}
    for nodes, run in runs.items():
        rows[nodes] = {
            "identical_to_chain": run.outputs == chain_tokens,
            "rounds": len(run.lengths),
            "mean_accept_length": round(statistics.fmean(run.lengths), 3),
            "accepted_depth_histogram": dict(sorted(run.depths.items())),
            "draft_ms_per_round": round(1e3 * run.draft_s / len(run.lengths), 1),
            "decode_ms_per_token": round(1e3 * run.decode_s / max(run.decoded, 1), 1),
            "verify_pass_ms": round(tree_verify_ms(middle, checkpoint.hidden_size, max(nodes, 1), args.tree_width), 2),
        }
    cloud_ms, cloud_tokens = cloud_decode(checkpoint, prompts, args.max_new_tokens, args.rtt_ms / 1e3)
    rows["cloud"] = {"identical_to_chain": cloud_tokens == chain_tokens, "decode_ms_per_token": round(cloud_ms, 1)}
    return rows


def print_rows(rows: dict, args) -> None:
    chain = rows[min(n for n in rows if n != "cloud")]
    print(
        f"\ndraft trees vs chain, same prompts, same run, emulated round trip {args.rtt_ms:.0f} ms per cloud call "
        f"(width {args.tree_width}, depth <= {args.max_draft}, grow while a path's draft probability >= "
        f"{args.tree_min_prob}):"
    )
    print(
        "  nodes  accept  draft ms/round  draft/chain  verify ms  decode ms/token  vs chain  identical  accepted depths"
    )
    for nodes, row in rows.items():
        if nodes == "cloud":
            speedup = chain["decode_ms_per_token"] / row["decode_ms_per_token"]
            print(
                f"  {'cloud':>5}  {'1.00':>6}  {'-':>14}  {'-':>11}  {'-':>9}  {row['decode_ms_per_token']:15.1f}  "
                f"{speedup:7.2f}x  {str(row['identical_to_chain']):>9}  (whole model per token, a round trip each)"
            )
            continue
        speedup = chain["decode_ms_per_token"] / row["decode_ms_per_token"]
        drafting = row["draft_ms_per_round"] / max(chain["draft_ms_per_round"], 1e-9)  # the target: <= 1.5x at tree16
        depths = " ".join(f"{d}:{n}" for d, n in row["accepted_depth_histogram"].items())
        print(
            f"  {nodes or 'chain':>5}  {row['mean_accept_length']:6.2f}  {row['draft_ms_per_round']:14.1f}  "
            f"{drafting:10.2f}x  {row['verify_pass_ms']:9.2f}  {row['decode_ms_per_token']:15.1f}  {speedup:7.2f}x  "
            f"{str(row['identical_to_chain']):>9}  {depths}"
        )


def run(args) -> dict:
    checkpoint, device, middle, prompts = load_bench_models(args)
    budgets = [int(n) for n in args.nodes.split(",")]
    rows = compare_budgets(checkpoint, device, middle, prompts, budgets, args)
    print_rows(rows, args)
    out = getattr(args, "out", None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "rtt_ms": args.rtt_ms,
                    "prompts": args.prompts,
                    "max_new_tokens": args.max_new_tokens,
                    "budgets": rows,
                },
                indent=2,
            )
            + "\n"
        )
    return rows
