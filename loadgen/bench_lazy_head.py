"""The device's greedy verdict with its LM head run lazily (rows up to the first disagreement, tree nodes along
the accepted walk) against the head run on every row sent (as before), side by side in one run, in process:
decode ms per token for a chain and for trees. Printed, never asserted; the outputs are the same tokens.

    python -m loadgen.bench_lazy_head --dtype int4 --nodes 0,8,16
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable

import torch

import shared.specdec.device_session as device_session
from loadgen.bench_core import bench_prompts, load_model
from shared.model.split import MiddleSubmodel
from shared.runtime import build_device_model
from shared.specdec.device_session import DeviceSession
from shared.specdec.draft_config import DraftConfig
from shared.specdec.engine import LocalCloud, generate

LAZY = {"chain": device_session.accept_greedy_lazily, "tree": device_session.accept_tree_greedy_lazily}


def every_row_first(verdict: Callable, rows: Callable[[list[int]], int]) -> Callable:
    """`verdict` (a lazy greedy rule) after asking for every row's argmax: the head's old cost."""

    def run(*args):
        *rest, target_argmax = args
        tokens = [target_argmax(row) for row in range(rows(rest[0]))]
        return verdict(*rest, lambda row: tokens[row])

    return run


def use(mode: str) -> None:
    if mode == "lazy":
        device_session.accept_greedy_lazily, device_session.accept_tree_greedy_lazily = LAZY["chain"], LAZY["tree"]
    else:  # a chain's verdict gets k draft tokens (k + 1 rows); a tree's, its N node tokens
        device_session.accept_greedy_lazily = every_row_first(LAZY["chain"], lambda drafts: len(drafts) + 1)
        device_session.accept_tree_greedy_lazily = every_row_first(LAZY["tree"], len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--nodes", default="0,8,16", help="draft nodes per round; 0: HAT's chain (eta)")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    checkpoint = load_model(args.model, args.dtype)
    middle = MiddleSubmodel(checkpoint, 2)
    device = build_device_model(checkpoint, 2, None)
    prompts = bench_prompts(checkpoint, args.prompts)

    def decode(config: DraftConfig) -> tuple[float, list[list[int]]]:
        seconds, tokens, answers = 0.0, 0, []
        for ids in prompts:
            session = DeviceSession(device, ids, draft_config=config, max_new_tokens=args.max_new_tokens)
            result = asyncio.run(generate(session, LocalCloud(middle)))
            seconds, tokens = seconds + result.wall_s - result.ttft_s, tokens + len(result.token_ids) - 1
            answers.append(result.token_ids)
        return seconds / tokens * 1e3, answers

    print(f"{args.model} {args.dtype}, 1 thread, {args.prompts} held-out prompts x {args.max_new_tokens} tokens")
    for repeat in range(args.repeats):
        for nodes in (int(n) for n in args.nodes.split(",")):
            config = DraftConfig(tree_nodes=nodes)
            spent, answers = {}, {}
            for mode in ("every row", "lazy"):
                use(mode)
                spent[mode], answers[mode] = decode(config)
            same = answers["lazy"] == answers["every row"]
            shape = "chain (eta)" if nodes == 0 else f"tree {nodes} nodes"
            print(f"  repeat {repeat + 1}, {shape:14s}: head on every row {spent['every row']:5.1f} ms/token, lazy "
                  f"{spent['lazy']:5.1f} ms/token ({spent['every row'] / spent['lazy']:.2f}x), same tokens: {same}")
    use("lazy")


if __name__ == "__main__":
    main()
