"""The GPU bench's CUDA-graph stages (loadgen/bench_gpu.py runs them): the fixed 1-row shapes replayed from CUDA
graphs against eager, and the verifier's served path (ModelRunner over the static KV layout) with its graphs
against its eager packed pass."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from loadgen.bench_core import sync, timed_ms
from shared.model.checkpoint import Checkpoint
from shared.model.split import LayerRange, MiddleSubmodel

GRAPH_NOTE = (
    "The runner's KV cache appends at a Python-side length, so a capture bakes the position in: every replay "
    "recomputes the row at position `context` in place (static input buffer, the cache's own storage). That times "
    "the fixed shape; serving from graphs would need one graph per position or a static KV layout."
)


@torch.inference_mode()
def graph_vs_eager(
    layers: LayerRange,
    hidden: int,
    context: int,
    make_input: Callable[[], torch.Tensor],
    embed: Callable[[torch.Tensor], torch.Tensor],
    finish: Callable[[torch.Tensor], torch.Tensor],
    repeats: int,
) -> dict[str, Any]:
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
    return {
        "eager_ms": eager_ms,
        "graph_ms": graph_ms,
        "speedup": eager_ms / graph_ms if graph_ms else None,
        "same_output": bool(torch.equal(static_out, expected)),
        "max_abs_diff": float((static_out.float() - expected.float()).abs().max()),
    }


def cuda_graphs(checkpoint: Checkpoint, split: int, context: int, repeats: int) -> dict[str, Any]:
    device = checkpoint.causal_lm.device
    if device.type != "cuda":
        return {"cuda_graphs": f"not attempted: the model is on {device}, not CUDA"}
    out: dict[str, Any] = {"context": context, "note": GRAPH_NOTE}
    decoder, head = checkpoint.decoder, checkpoint.lm_head
    parts = {
        "verify_1row": (
            MiddleSubmodel(checkpoint, split),
            lambda: torch.randn(1, checkpoint.hidden_size, dtype=checkpoint.causal_lm.dtype, device=device),
            lambda x: x,
            lambda h: h,
        ),
        # the whole decode step on the GPU: layers, final norm, head, argmax (the runner's head answers on the CPU)
        "decode_step_1row": (
            LayerRange(checkpoint, 0, checkpoint.num_layers),
            lambda: torch.tensor([5], device=device),
            decoder.embed_tokens,
            lambda h: head(decoder.norm(h)).argmax(-1),
        ),
    }
    for name, (layers, make_input, embed, finish) in parts.items():
        try:
            out[name] = graph_vs_eager(layers, checkpoint.hidden_size, context, make_input, embed, finish, repeats)
        except Exception as exc:  # noqa: BLE001 - a capture that fails is a result, not the end of the run
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


SERVED_NOTE = (
    "the verifier's ModelRunner.run (checks, rollback, the pass, replies copied to the CPU) for one "
    "verify item of N rows after `context` positions, in the static KV layout: its passes replayed "
    "from CUDA graphs (on the CPU: the same static-shape pass run eagerly) vs the eager packed pass"
)


def served_graphs(checkpoint: Checkpoint, split: int, context: int, rows: list[int], repeats: int) -> dict[str, Any]:
    """Graph vs eager verify ms per row count through the served path (services/verifier_cloud/runner.py)."""
    from services.verifier_cloud.kv_plan import KVPlan
    from services.verifier_cloud.runner import ModelRunner, RunItem
    from services.verifier_cloud.work import WorkKind

    middle = MiddleSubmodel(checkpoint, split)
    device, dtype, hidden = middle.device, middle.dtype, checkpoint.hidden_size
    on_cuda = device.type == "cuda"
    plan = KVPlan.decide("static", "on", ",".join(map(str, sorted(rows))), on_cuda, 2**40, 2)
    pool, passes = plan.runner_parts(middle, context + max(rows))
    assert passes is not None  # cuda_graphs on: the static-shape passes
    runners = {
        "graph" if on_cuda else "static_eager": ModelRunner(middle, context + max(rows), None, pool, passes),
        "eager": ModelRunner(middle, context + max(rows), None, pool),
    }
    prefix = torch.randn(context, hidden, dtype=dtype)
    out: dict[str, Any] = {"context": context, "path": next(iter(runners)), "note": SERVED_NOTE}
    for runner in runners.values():
        runner.open(1)
        result = runner.run([RunItem(1, WorkKind.PREFILL, 0, prefix)])[0]
        assert result.error is None, result.error
    for n in rows:
        states = torch.randn(n, hidden, dtype=dtype)
        item = RunItem(1, WorkKind.VERIFY, context, states)  # a verify at `context` rolls the last one back
        outputs, times = {}, {}
        for name, runner in runners.items():
            times[name] = timed_ms(partial(runner.run, [item]), device, repeats, warmup=2)
            output = runner.run([item])[0].output
            assert isinstance(output, torch.Tensor)  # a hidden-state verify answers with its deep states
            outputs[name] = output
        fast = next(iter(runners))
        out[str(n)] = {
            **{f"{name}_ms": ms for name, ms in times.items()},
            "speedup": times["eager"] / times[fast],
            "max_abs_diff": float((outputs[fast].float() - outputs["eager"].float()).abs().max()),
        }
    out["counts"] = dict(passes.counts)
    for runner in runners.values():
        runner.close(1)
    return out
