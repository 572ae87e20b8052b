"""Does torch.compile pay for the runner? Unsplit greedy decode tok/s, eager against each layer's norm + MLP
compiled by inductor (the part without KV bookkeeping), same process, same prompt, with the compile time.

    python -m loadgen.bench_compile --dtype int4 --threads 1

Measured on this box it did not pay (README, "The engine"), so the runner stays eager; this is how to
check again on another machine or torch.
"""

from __future__ import annotations

import argparse
import time

import torch

import shared.model.layers as layers
from loadgen.bench_engine import load
from shared.model.split import LayerRange, OutputSubmodel


@torch.inference_mode()
def decode_rate(whole: LayerRange, head: OutputSubmodel, embed, new_tokens: int = 48) -> float:
    cache = whole.new_cache()
    whole.forward_packed(embed(torch.arange(100, 160)), [cache], [60])
    token, started = 5, time.perf_counter()
    for _ in range(new_tokens):
        hidden = whole.forward_packed(embed(torch.tensor([token])), [cache], [1])
        token = int(head(hidden)[0].argmax())
    rate = new_tokens / (time.perf_counter() - started)
    cache.free()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = load(args.model, args.dtype)
    whole, head = LayerRange(checkpoint, 0, checkpoint.num_layers), OutputSubmodel(checkpoint)
    embed = checkpoint.decoder.embed_tokens
    decode_rate(whole, head, embed)
    eager = decode_rate(whole, head, embed)

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
        decode_rate(whole, head, embed)
        first = time.perf_counter() - started
        rate = decode_rate(whole, head, embed)
    finally:
        layers.decoder_layer_forward = original
    print(f"{args.dtype}, {args.threads} thread(s): eager {eager:.1f} tok/s, compiled norm+MLP {rate:.1f} tok/s "
          f"({rate / eager:.2f}x), compile + first run {first:.1f} s")


if __name__ == "__main__":
    main()
