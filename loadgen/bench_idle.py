"""What waiting costs the next pass: one verify pass of the middle layers, timed back to back, after the thread
slept between passes (as a verifier waiting for the next round does), after it spun, and after it read a
device-sized working set. Printed side by side in one run, never asserted.

    tophat bench idle --dtype int4 --gap-ms 25
"""

from __future__ import annotations

import argparse
import time

import torch

from loadgen.bench_core import load_model
from shared.model.split import MiddleSubmodel

CONTEXT = 100  # cached positions before each pass


def _wait(mode: str, gap_s: float, working_set: torch.Tensor) -> None:
    if mode == "sleep":
        time.sleep(gap_s)
    elif mode == "spin":
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            pass
    elif mode == "touch":
        working_set.sum()


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    checkpoint = load_model(args.model, args.dtype)
    middle = MiddleSubmodel(checkpoint, args.split_layers)
    cache = middle.new_cache()
    rows = torch.randn(args.rows, checkpoint.hidden_size, dtype=middle.dtype)
    working_set = torch.randn(40 * 2**20 // 4)  # about what a device's layers, adapter and head read
    with torch.inference_mode():
        middle.forward_batch([(cache, torch.randn(CONTEXT, checkpoint.hidden_size, dtype=middle.dtype))])
        print(f"{args.model} {args.dtype}, {args.rows}-row verify pass, 1 thread, {args.gap_ms:.0f} ms between passes")
        for round_index in range(args.rounds):
            for mode in ("back to back", "sleep", "spin", "touch 40 MB"):
                spent = []
                for _ in range(args.passes):
                    started = time.perf_counter()
                    cache.truncate(CONTEXT)
                    middle.forward_batch([(cache, rows)])
                    spent.append(time.perf_counter() - started)
                    _wait(mode.split()[0], args.gap_ms / 1e3, working_set)
                spent.sort()
                mean, median = sum(spent) / len(spent) * 1e3, spent[len(spent) // 2] * 1e3
                print(f"  round {round_index + 1}, {mode:12s}: mean {mean:6.1f} ms, median {median:6.1f} ms")
