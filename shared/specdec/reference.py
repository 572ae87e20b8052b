"""The unsplit model decoding one token at a time: the ground truth that every
split / speculative mode must reproduce token for token (greedy, fp32)."""

from __future__ import annotations

import time

import torch

from shared.model.checkpoint import Checkpoint
from shared.specdec.decode_loop import GenerationResult
from shared.specdec.sampling import SamplingParams, sample_logits

_DEFAULT_PARAMS = SamplingParams()  # frozen: one shared default


@torch.inference_mode()
def generate_full(
    checkpoint: Checkpoint, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams = _DEFAULT_PARAMS
) -> GenerationResult:
    model = checkpoint.model
    generator = torch.Generator()
    if params.seed is not None:
        generator.manual_seed(params.seed)
    started = time.perf_counter()
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    tokens: list[int] = []
    times: list[float] = []
    while True:
        token = sample_logits(out.logits[0, -1], params, generator)
        tokens.append(token)
        times.append(time.perf_counter() - started)
        if len(tokens) >= max_new_tokens or token == checkpoint.eos_token_id:
            break
        out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return GenerationResult(tokens, [1] * (len(tokens) - 1), times, time.perf_counter() - started)
