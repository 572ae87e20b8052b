"""`make bench-core`: the in-process model core on held-out prompts, printed, never asserted.

Prints ms per draft step, ms per verify pass by number of draft tokens, the
accept-length distribution, and the decode speedup of `hat` over `ushape`
measured side by side in this run (same prompts, same process, same threads).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import Counter

import torch
from transformers.generation.streamers import BaseStreamer

from shared.chat import has_chat_template
from shared.model.checkpoint import Checkpoint, load_checkpoint
from shared.model.split import LayerRange, MiddleSubmodel, OutputSubmodel
from shared.runtime import build_device_model
from shared.specdec.decode_loop import GenerationResult, LocalCloud, generate
from shared.specdec.device_session import DeviceSession, DraftConfig
from tophatctl.demo_model.corpus import held_out_prompts
from tophatctl.models import resolve_model


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3 if samples else float("nan")


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; the CPU computes as it goes)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(step, device: torch.device | str, repeats: int, warmup: int = 1, before=None) -> float:
    """Median ms of `step()` on `device`, the clock read only once the device is done (`before()`, untimed,
    runs ahead of each call, e.g. to roll a KV cache back); `warmup` untimed calls first."""
    samples = []
    for index in range(warmup + repeats):
        if before is not None:
            before()
        sync(device)
        started = time.perf_counter()
        step()
        sync(device)
        if index >= warmup:
            samples.append(time.perf_counter() - started)
    return _median_ms(samples)


def time_verify_passes(
    middle: MiddleSubmodel, hidden_size: int, context: int, max_k: int, repeats: int
) -> dict[int, float]:
    """Median ms of one middle pass over k+1 positions after a `context`-long prefix."""
    cache = middle.new_cache()
    middle.forward_batch([(cache, torch.randn(context, hidden_size))])
    result = {}
    for k in range(max_k + 1):
        samples = []
        for _ in range(repeats):
            cache.truncate(context)
            started = time.perf_counter()
            middle.forward_batch([(cache, torch.randn(k + 1, hidden_size))])
            samples.append(time.perf_counter() - started)
        result[k] = _median_ms(samples)
    return result


def time_draft_steps(device, prompt_ids: list[int], steps: int) -> float:
    session = DeviceSession(
        device, prompt_ids, draft_config=DraftConfig(eta=0.0, max_draft=steps), max_new_tokens=steps + 2
    )
    session.ignore_eos = True  # the zero deep state below may well read as an end of turn: draft all the same
    session.prefill_chunk(len(prompt_ids))
    session.on_prefill_result(torch.zeros(1, device.hidden_size))  # a deep state for a feature adapter to read
    session.pending_token = prompt_ids[-1]
    started = time.perf_counter()
    draft = session.draft()
    return (time.perf_counter() - started) / (len(draft.tokens) + 1)


class DelayedCloud(LocalCloud):
    """LocalCloud plus a fixed emulated round-trip time per cloud call (the network HAT saves)."""

    def __init__(self, middle, rtt_s: float):
        super().__init__(middle)
        self.rtt_s = rtt_s

    async def send_prefill(self, *args):
        await asyncio.sleep(self.rtt_s)
        return await super().send_prefill(*args)

    async def verify(self, *args):
        await asyncio.sleep(self.rtt_s)
        return await super().verify(*args)


def bench_prompts(checkpoint, count: int) -> list[list[int]]:
    """Held-out chat prompts through the model's chat template; held-out stdlib code for a model
    without one (the demo model)."""
    if has_chat_template(checkpoint.tokenizer):
        from tophatctl.adapter_training.dataset import user_prompt_ids
        from tophatctl.adapter_training.prompts import HELD_OUT_CHAT_PROMPTS

        return [user_prompt_ids(checkpoint, p) for p in HELD_OUT_CHAT_PROMPTS[:count]]
    return [checkpoint.tokenizer.encode(p, add_special_tokens=False) for p in held_out_prompts(count, seed=11)]


@torch.inference_mode()
def decode_rate(
    checkpoint: Checkpoint, prompts: list[list[int]], new_tokens: int, runs: int = 2
) -> tuple[float, list[list[int]]]:
    """Aggregate tok/s of greedy decoding len(prompts) sessions together (one packed row each per step),
    the best of `runs` runs, and each session's tokens (new_tokens + 1: the prefill's, then one per step),
    on the device the checkpoint's weights are on."""
    whole, head = LayerRange(checkpoint, 0, checkpoint.num_layers), OutputSubmodel(checkpoint)
    embed, device = checkpoint.decoder.embed_tokens, whole.device
    best, tokens = 0.0, []
    for _ in range(runs):
        caches = [whole.new_cache() for _ in prompts]
        firsts = [
            whole.forward_packed(embed(torch.tensor(p, device=device)), [c], [len(p)])[-1:]
            for p, c in zip(prompts, caches)
        ]
        tokens = [[int(t)] for t in head(torch.cat(firsts)).argmax(-1)]  # the head answers on the CPU: synced
        lengths = [1] * len(prompts)
        started = time.perf_counter()
        for _ in range(new_tokens):
            ids = torch.tensor([t[-1] for t in tokens], device=device)
            hidden = whole.forward_packed(embed(ids), caches, lengths)  # [B, H]
            for row, token in zip(tokens, head(hidden).argmax(-1)):
                row.append(int(token))
        best = max(best, len(prompts) * new_tokens / (time.perf_counter() - started))
        for cache in caches:
            cache.free()
    return best, tokens


class _TokenClock(BaseStreamer):
    """The time at which generate hands out each batch of ids: the prompt first, then one token per step."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def transformers_rate(checkpoint: Checkpoint, prompts: list[list[int]], new_tokens: int) -> float:
    """Aggregate decode tok/s of transformers' greedy `generate` over len(prompts) sequences in one batch
    (left-padded, with an attention mask), on the model's device: the clock runs from the prefill's token to
    the last of new_tokens more, as generate hands them out (the fastest of three runs)."""
    model = checkpoint.causal_lm
    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    options = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0)

    def decode_seconds() -> float:
        # Timed inside one run, not as a full run less a prefill-only run: two runs' pauses differ, and the
        # difference of two short runs came out negative on a busy CPU (CI saw -704 tok/s).
        clock = _TokenClock()
        model.generate(**options, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, streamer=clock)
        assert len(clock.times) == new_tokens + 2, "generate handed out a token count other than asked"
        return clock.times[-1] - clock.times[1]  # each put copies the tokens to the host: the step has finished

    decode_seconds()  # warm-up
    return len(prompts) * new_tokens / min(decode_seconds() for _ in range(3))


def unsplit_decode_rates(checkpoint, prompt_ids: list[int], new_tokens: int, threads: int) -> dict[str, float]:
    """Tokens/s of plain greedy decoding after the prompt, one token per pass: the project's own
    layer runner over all layers, and transformers' generate, on the same prompt and threads."""
    torch.set_num_threads(threads)
    return {
        "tophat runner": decode_rate(checkpoint, [prompt_ids], new_tokens)[0],
        "transformers generate": transformers_rate(checkpoint, [prompt_ids], new_tokens),
    }


def load_model(model: str, dtype: str = "f32") -> Checkpoint:
    """f32 | bf16 | int8 | int4, or int8+sdpa | int4+sdpa: quantized, but attention in one SDPA call per pass
    (faster, not batch-invariant, so not lossless where two logits are close: docs/design/engine.md, precision)."""
    kind, _, attention = dtype.partition("+")
    if kind in ("int8", "int4"):
        checkpoint = load_checkpoint(resolve_model(model), quantize=kind)
        if attention == "sdpa":
            checkpoint.model.set_attn_implementation("sdpa")  # type: ignore[operator]
        return checkpoint
    return load_checkpoint(resolve_model(model), dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)


def load_bench_models(args):
    """(checkpoint, device model with its adapter, middle submodel, held-out prompts) from the options of
    `tophat bench core`, `trees` or `budget`, with torch's threads set: what every in-process core bench starts
    from."""
    torch.set_num_threads(args.threads)
    checkpoint = load_model(args.model, args.dtype)
    device = build_device_model(checkpoint, args.split_layers, args.adapter, speculative=True)
    middle = MiddleSubmodel(checkpoint, args.split_layers)
    return checkpoint, device, middle, bench_prompts(checkpoint, args.prompts)


Runs = dict[tuple[str, float], list[GenerationResult]]  # (mode, emulated round trip ms) -> one result a prompt


def main(args: argparse.Namespace) -> None:
    checkpoint, hat_device, middle, prompts = load_bench_models(args)
    ushape_device = build_device_model(checkpoint, args.split_layers, None, speculative=False)
    print(
        f"model {args.model}: {checkpoint.num_layers} layers, hidden {checkpoint.hidden_size}, m={args.split_layers}, "
        f"{args.dtype} weights, eta={args.eta}, max draft {args.max_draft}, {args.prompts} held-out prompts, "
        f"torch threads {args.threads}"
    )
    _print_passes(args, checkpoint, hat_device, middle, prompts)
    runs = _run_modes(args, {"ushape": ushape_device, "hat": hat_device}, middle, prompts)
    _print_accept_lengths(runs[("hat", 0.0)])
    _print_decode(runs, (0.0, args.rtt_ms))


def _print_passes(args: argparse.Namespace, checkpoint: Checkpoint, hat_device, middle, prompts) -> None:
    """The single passes: unsplit decode beside transformers, a draft step, a verify pass per draft length."""
    print(
        "\nunsplit greedy decode, same prompt, tokens/s (anchor from issue 10: llama.cpp on this GGUF, 62 on 1 "
        "thread, 83 on 2):"
    )
    for threads in (1, args.threads):
        rates = unsplit_decode_rates(checkpoint, prompts[0], 64, threads)
        print(f"  {threads} thread(s): " + ", ".join(f"{name} {rate:5.1f}" for name, rate in rates.items()))
    torch.set_num_threads(args.threads)
    draft_ms = _median_ms([time_draft_steps(hat_device, p, 8) for p in prompts[:4]])
    print(f"\ndraft step (input layers + adapter + head): {draft_ms:.2f} ms")
    print("\nverify pass (middle submodel, 128-token context) by number of draft tokens k:")
    for k, ms in time_verify_passes(middle, checkpoint.hidden_size, 128, args.max_draft, 7).items():
        print(f"  k={k:2d} ({k + 1:2d} positions): {ms:6.2f} ms")


def _run_modes(args: argparse.Namespace, devices: dict, middle, prompts: list[list[int]]) -> Runs:
    """Every prompt generated in each mode, in process and over the emulated round trip, the modes
    interleaved prompt by prompt so that both see the same machine; hat must answer as ushape does."""
    runs: Runs = {}
    for rtt_ms in (0.0, args.rtt_ms):
        for mode in devices:
            runs[(mode, rtt_ms)] = []
        for index, ids in enumerate(prompts):
            for mode, device in devices.items():
                session = DeviceSession(
                    device, ids, draft_config=DraftConfig(args.eta, args.max_draft), max_new_tokens=args.max_new_tokens
                )
                cloud = DelayedCloud(middle, rtt_ms / 1e3)
                runs[(mode, rtt_ms)].append(asyncio.run(generate(session, cloud, session_id=index + 1)))
    for a, b in zip(runs[("ushape", 0.0)], runs[("hat", 0.0)]):
        assert a.token_ids == b.token_ids, "hat diverged from ushape: speculation is not lossless"
    return runs


def _print_accept_lengths(results: list[GenerationResult]) -> None:
    lengths = Counter(n for r in results for n in r.accept_lengths)
    total = sum(lengths.values())
    print("\naccept length distribution (tokens per verification round, hat):")
    for n in sorted(lengths):
        print(f"  {n:2d}: {lengths[n] / total:6.1%} {'#' * round(40 * lengths[n] / total)}")
    mean_accept = sum(n * c for n, c in lengths.items()) / total
    print(f"  mean accept length: {mean_accept:.2f}")


def _print_decode(runs: Runs, rtts: tuple[float, ...]) -> None:
    """ms per decoded token and TTFT per mode at each round trip, and hat's decode speedup over ushape."""

    def decode_s(mode: str, rtt_ms: float) -> float:
        return sum(r.wall_s - r.ttft_s for r in runs[(mode, rtt_ms)])

    def tokens(mode: str, rtt_ms: float) -> int:
        return sum(len(r.token_ids) - 1 for r in runs[(mode, rtt_ms)])

    for rtt_ms in rtts:
        label = "in-process, no network" if rtt_ms == 0 else f"emulated round trip {rtt_ms:.0f} ms per cloud call"
        print(f"\ndecode (after the first token), same prompts, same run, {label}:")
        for mode in ("ushape", "hat"):
            ttft = statistics.mean(r.ttft_s for r in runs[(mode, rtt_ms)]) * 1e3
            print(
                f"  {mode:7s}: {decode_s(mode, rtt_ms) / tokens(mode, rtt_ms) * 1e3:6.2f} ms/token, TTFT {ttft:6.1f} ms"
            )
        print(
            f"  decode speedup hat / ushape: {decode_s('ushape', rtt_ms) / decode_s('hat', rtt_ms):.2f}x "
            "(outputs token-identical)"
        )
