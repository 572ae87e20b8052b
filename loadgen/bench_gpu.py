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
  served_graphs the verifier's runner in the static KV layout, a verify item of each --rows count: its pass
                replayed from the CUDA graph of its bucket vs the eager pass, ms and the states' max difference
                (on the CPU the static-shape pass runs eagerly: a check that the path works, not a speed)

    tophat bench gpu --model smollm2 --device cuda --dtype bf16 --out bench-results/gpu.json
    tophat bench gpu --model demo --device cpu --dtype f32 --sessions 1,2 --rows 1,4 --new-tokens 8

Weights (--weights): `checkpoint` loads the model directory's safetensors; `random` initialises the same
architecture (its config.json, or SmolLM2-135M's below when only the committed adapter is there) from a fixed
seed: speeds depend on shapes only, so they stand, but accept lengths then mean nothing and greedy ties are
closer. `auto` (the default) takes the checkpoint when its weights are there, else random, and says so in the
JSON and the table. SmolLM2's imported weights (538 MB, git-ignored) are not in a checkout copied elsewhere.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loadgen.bench_core import decode_rate, transformers_rate
from loadgen.bench_engine import verify_ms
from loadgen.cuda_graph_checks import cuda_graphs, served_graphs
from loadgen.gpu_checks import greedy_check, place_model, prompts_for

log = logging.getLogger("bench_gpu")

STAGES = (
    "placement",
    "greedy",
    "decode",
    "verify",
    "transformers",
    "greedy_demo",
    "greedy_f32",
    "cuda_graphs",
    "served_graphs",
)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


class Run:
    """The results so far, written out after every step; stages run under a deadline and their own try."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.started = time.perf_counter()
        self.out = Path(args.out)
        self.results: dict[str, Any] = {
            "argv": sys.argv[1:],
            "time_budget_s": args.time_budget_s,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "stages": {},
        }

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

    def sweep(
        self, record: dict[str, Any], key: str, sizes: list[int], unit: str, measure: Callable[[int], Any]
    ) -> None:
        """measure(n) into record[key][str(n)] for each size n, the JSON rewritten after each, until the time
        budget is spent (record["cut_short"] then says before which)."""
        values = record.setdefault(key, {})
        for n in sizes:
            if self.out_of_time():
                record["cut_short"] = f"time budget spent before {n} {unit}"
                break
            values[str(n)] = measure(n)
            self.save()

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


class GpuStages:
    """The stages' bodies, each filling its record; `held` is what placement loaded for the others."""

    def __init__(self, args: argparse.Namespace, bench: Run):
        self.args = args
        self.bench = bench
        self.held: dict[str, Any] = {}

    def placement(self, record: dict[str, Any]) -> None:
        args = self.args
        checkpoint, place, info = place_model(args.model, args.device, args.dtype, args.weights)
        count = max([args.greedy_prompts, *args.sessions, *args.hf_sessions])
        prompts, source = prompts_for(checkpoint, count)
        self.held.update(checkpoint=checkpoint, placement=place, prompts=prompts)
        record.update(info, prompts=source, prompt_tokens=[len(p) for p in prompts[: args.greedy_prompts]])
        self.bench.results["meta"] = info

    def greedy(self, record: dict[str, Any]) -> None:
        args = self.args
        prompts = self.held["prompts"][: args.greedy_prompts]
        record.update(
            greedy_check(
                self.held["checkpoint"],
                args.split_layers,
                args.adapter,
                prompts,
                args.greedy_tokens,
                args.eta,
                args.max_draft,
            )
        )

    def decode(self, record: dict[str, Any]) -> None:
        self._rates(record, self.args.sessions, "sessions", lambda *run: decode_rate(*run)[0])

    def verify(self, record: dict[str, Any]) -> None:
        args, checkpoint = self.args, self.held["checkpoint"]
        record.update(context=args.context, middle_layers=checkpoint.num_layers - args.split_layers)
        self.bench.sweep(
            record,
            "ms",
            args.rows,
            "rows",
            lambda rows: verify_ms(checkpoint, args.split_layers, rows, args.context, args.repeats),
        )

    def reference(self, record: dict[str, Any]) -> None:
        self._rates(record, self.args.hf_sessions, "sequences", transformers_rate)

    def _rates(
        self, record: dict[str, Any], counts: list[int], unit: str, rate: Callable[[Any, list[list[int]], int], float]
    ) -> None:
        """Aggregate decode tok/s, rate(checkpoint, prompts, new_tokens), over the first n prompts for each n."""
        checkpoint, prompts, new_tokens = self.held["checkpoint"], self.held["prompts"], self.args.new_tokens
        record["new_tokens"] = new_tokens
        self.bench.sweep(record, "tok_s", counts, unit, lambda n: rate(checkpoint, prompts[:n], new_tokens))

    def greedy_demo(self, record: dict[str, Any]) -> None:
        if self.args.model == "demo":
            record["same_as"] = "greedy (the main model is the demo model)"
            return
        self._greedy_again(record, "demo", self.args.dtype, "checkpoint", None)

    def greedy_f32(self, record: dict[str, Any]) -> None:
        if self.held["placement"].dtype == torch.float32:
            record["same_as"] = "greedy (the run is in float32)"
            return
        self._greedy_again(record, self.args.model, "f32", self.args.weights, self.args.adapter)

    def _greedy_again(self, record: dict[str, Any], model: str, dtype: str, weights: str, adapter: str | None) -> None:
        """The greedy check on another model or dtype, loaded for it alone (freed on return)."""
        args = self.args
        checkpoint, _, info = place_model(model, args.device, dtype, weights)
        record.update(placement=info["placement"], weights_source=info["weights_source"])
        prompts, record["prompts_source"] = prompts_for(checkpoint, args.greedy_prompts)
        record.update(
            greedy_check(checkpoint, args.split_layers, adapter, prompts, args.greedy_tokens, args.eta, args.max_draft)
        )

    def graphs(self, record: dict[str, Any]) -> None:
        args = self.args
        record.update(cuda_graphs(self.held["checkpoint"], args.split_layers, args.context, max(args.repeats, 20)))

    def served(self, record: dict[str, Any]) -> None:
        args = self.args
        record.update(
            served_graphs(self.held["checkpoint"], args.split_layers, args.context, args.rows, max(args.repeats, 20))
        )


def run(args: argparse.Namespace) -> dict[str, Any]:
    bench = Run(args)
    stages = GpuStages(args, bench)
    bench.stage("placement", stages.placement)
    for name, body in (
        ("greedy", stages.greedy),
        ("decode", stages.decode),
        ("verify", stages.verify),
        ("transformers", stages.reference),
        ("greedy_demo", stages.greedy_demo),
        ("greedy_f32", stages.greedy_f32),
        ("cuda_graphs", stages.graphs),
        ("served_graphs", stages.served),
    ):
        bench.stage(name, body, stages.held.get("checkpoint"))
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
                f" ({stage['error']})" if "error" in stage else ""
            )
        return (
            f"{stage['equal']}/{stage['prompts']} equal, mean accept length "
            f"{_fmt(stage['mean_accept_length'], 2)}, HAT in process {_fmt(stage['hat_in_process_tok_s'])} tok/s"
        )

    greedy = stages.get("greedy", {})
    lines.append(
        f"| greedy HAT == unsplit ({greedy.get('prompts', args.greedy_prompts)} prompts x "
        f"{args.greedy_tokens} tokens) | {greedy_row(greedy)} |"
    )
    lines.append(f"| same, demo model (trained weights + adapter) | {greedy_row(stages.get('greedy_demo', {}))} |")
    lines.append(f"| same, float32 on the same device | {greedy_row(stages.get('greedy_f32', {}))} |")
    sessions = " / ".join(map(str, args.sessions))
    lines.append(
        f"| unsplit decode tok/s, {sessions} sessions | {_row(stages.get('decode', {}), 'tok_s', args.sessions)} |"
    )
    hf = " / ".join(map(str, args.hf_sessions))
    lines.append(
        f"| transformers generate tok/s, {hf} sequences | "
        f"{_row(stages.get('transformers', {}), 'tok_s', args.hf_sessions)} |"
    )
    verify = stages.get("verify", {})
    rows = " / ".join(map(str, args.rows))
    lines.append(
        f"| verify pass ms ({verify.get('middle_layers', '?')} layers, {args.context} cached), {rows} rows | "
        f"{_row(verify, 'ms', args.rows, 2)} |"
    )
    graphs = stages.get("cuda_graphs", {})
    for name, label in (("verify_1row", "1-row verify pass"), ("decode_step_1row", "1-row unsplit decode step")):
        part = graphs.get(name)
        if isinstance(part, dict) and "graph_ms" in part:
            value = (
                f"eager {_fmt(part['eager_ms'], 2)} ms, graph {_fmt(part['graph_ms'], 2)} ms "
                f"({_fmt(part['speedup'], 2)}x), same output: {part['same_output']}"
            )
        elif isinstance(part, dict):
            value = part.get("error", "?")
        else:
            value = graphs.get("cuda_graphs") or graphs.get("status", "not run")
        lines.append(f"| CUDA graph, {label} | {value} |")
    served = stages.get("served_graphs", {})
    path = served.get("path", "graph")
    lines.append(
        f"| served verify ms, {path} / eager, {rows} rows | "
        + (
            " / ".join(
                f"{_fmt(served[str(n)].get(f'{path}_ms'), 2)}/{_fmt(served[str(n)].get('eager_ms'), 2)}"
                for n in args.rows
                if str(n) in served
            )
            or served.get("status", "not run")
        )
        + " |"
    )
    lines.append(f"\n{results.get('elapsed_s', 0):.1f} s in all; JSON: {args.out}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
