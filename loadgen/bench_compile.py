"""Does torch.compile pay for the runner? Unsplit greedy decode tok/s, eager against each layer's norm + MLP
compiled by inductor (the part without KV bookkeeping), same process, same prompt, with the compile time.

    tophat bench compile --dtype int4 --threads 1

Measured on this box it did not pay (docs/design/engine.md), so the runner stays eager; this is how to
check again on another machine or torch.
"""

from __future__ import annotations

import argparse
import time

import torch

import shared.model.layers as layers
from loadgen.bench_core import decode_rate, load_model


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    checkpoint = load_model(args.model, args.dtype)
    prompts = [list(range(100, 160))]
    eager = decode_rate(checkpoint, prompts, 48)[0]  # best of two runs: the first warms up

    def norm_and_mlp(hidden, norm, fused):
        gate, up = fused.gate_up(layers.rms_norm(norm, hidden)).chunk(2, dim=-1)
        return hidden + fused.down(torch.nn.functional.silu(gate) * up)

    compiled = torch.compile(norm_and_mlp, dynamic=True)

    def layer_forward(layer, hidden, caches, plan):
        fused = layers.fused_layer(layer)
        normed = layers.rms_norm(layer.input_layernorm, hidden)
        hidden = hidden + layers.attention(fused.attention, normed, caches, plan)
        return compiled(hidden, layer.post_attention_layernorm, fused)

    original = layers.decoder_layer_forward
    layers.decoder_layer_forward = layer_forward
    try:
        started = time.perf_counter()
        rate = decode_rate(checkpoint, prompts, 48)[0]  # layers.decoder_layer_forward is looked up per pass
        first = time.perf_counter() - started
    finally:
        layers.decoder_layer_forward = original
    print(
        f"{args.dtype}, {args.threads} thread(s): eager {eager:.1f} tok/s, compiled norm+MLP {rate:.1f} tok/s "
        f"({rate / eager:.2f}x), compile + two runs {first:.1f} s"
    )
