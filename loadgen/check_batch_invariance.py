"""Is the unsplit model's greedy answer the same whether its rows are computed one per pass or together?

`generate_full` (the reference of every lossless test) decodes one row per pass; the mesh verifies several
rows in one pass. For each dtype this decodes the held-out chat prompts step by step, scores the same
tokens again in one pass, and counts the prompts whose argmax differs somewhere, and the exact top-2 ties
in the logits. Run: `tophat bench batch-invariance [--dtypes int4,int8,f32] [--prompts 24]`.

Quantized models run batch-invariant attention (shared/model/invariant_attention.py); `--attention sdpa`
switches them back to one scaled-dot-product call per pass, to show the gap that closes.
"""

from __future__ import annotations

import argparse

import torch

from shared.model.checkpoint import load_checkpoint
from shared.specdec.reference import generate_full
from tophatctl.adapter_training.dataset import user_prompt_ids
from tophatctl.adapter_training.prompts import HELD_OUT_CHAT_PROMPTS
from tophatctl.models import resolve_model_or_exit


def check(model_dir: str, dtype: str, prompts: list[str], new_tokens: int, attention: str) -> dict[str, int]:
    checkpoint = load_checkpoint(model_dir, quantize=None if dtype == "f32" else dtype)
    if attention == "sdpa":
        checkpoint.model.set_attn_implementation("sdpa")  # type: ignore[operator]
    differing, ties, positions = 0, 0, 0
    for prompt in prompts:
        ids = user_prompt_ids(checkpoint, prompt)
        stepwise = generate_full(checkpoint, ids, new_tokens).token_ids
        with torch.inference_mode():
            logits = checkpoint.model(input_ids=torch.tensor([ids + stepwise])).logits[0]  # [P + N, V]
        scored = logits[len(ids) - 1 : len(ids) - 1 + len(stepwise)]  # [N, V]: the logits each token came from
        top2 = scored.topk(2).values  # [N, 2]
        ties += int((top2[:, 0] == top2[:, 1]).sum())
        positions += len(stepwise)
        differing += int(scored.argmax(-1).tolist() != stepwise)
    return {"prompts": len(prompts), "differing_prompts": differing, "tied_positions": ties, "positions": positions}


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    prompts = list(HELD_OUT_CHAT_PROMPTS[: args.prompts])
    for dtype in args.dtypes.split(","):
        result = check(str(resolve_model_or_exit(args.model)), dtype, prompts, args.new_tokens, args.attention)
        attention = args.attention if dtype != "f32" else "sdpa"
        print(
            f"{dtype} ({attention} attention): stepwise greedy != one-pass argmax on "
            f"{result['differing_prompts']}/{result['prompts']} prompts; "
            f"exact top-2 logit ties at {result['tied_positions']}/{result['positions']} positions"
        )
