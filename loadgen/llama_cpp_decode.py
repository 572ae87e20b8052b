"""llama.cpp on a GGUF, for `make bench-engine`: greedy decode tokens/s, greedy answers to many prompts, and
teacher-forced logits.

Runs in its own virtual environment (.venv-llama, llama-cpp-python built from source), so it imports nothing
from this project. Three uses:
  python llama_cpp_decode.py GGUF --prompt-ids 1,2,3 --new-tokens 64     one JSON line {"tok_s", "token_ids"}
  python llama_cpp_decode.py GGUF --prompts-file P.json --new-tokens 48  {"answers": [[ids], ...]}, greedy, one
                                                                           prompt at a time
  python llama_cpp_decode.py GGUF --windows-file W.json --logits-dir D   D/<i>.npy: float32 logits [n, vocab] of
                                                                           window i, every position (teacher-forced)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def greedy(llm, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    """The greedy answer and the seconds its decode steps took (the prompt's pass not counted)."""
    llm.reset()
    llm.eval(prompt)
    tokens = []
    started = time.perf_counter()
    for _ in range(new_tokens):
        token = int(llm.scores[llm.n_tokens - 1].argmax())  # greedy on the last position's logits
        tokens.append(token)
        llm.eval([token])
    return tokens, time.perf_counter() - started


def main() -> None:
    import numpy as np
    from llama_cpp import Llama

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-ids", help="comma-separated token ids (the same prompt as ours)")
    parser.add_argument("--prompts-file", help="a JSON list of prompts' token ids: greedy answers to each")
    parser.add_argument("--windows-file", help="a JSON list of token windows: their logits at every position")
    parser.add_argument("--logits-dir", help="where the windows' logits go, one .npy each")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.windows_file:
        windows = json.loads(Path(args.windows_file).read_text())
        context = max(len(w) for w in windows)
        llm = Llama(
            model_path=args.gguf,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            n_ctx=context,
            n_batch=context,
            logits_all=True,
            verbose=False,
        )
        for i, window in enumerate(windows):
            llm.reset()
            llm.eval(window)
            np.save(Path(args.logits_dir) / f"{i}.npy", np.asarray(llm.scores[: len(window)], dtype=np.float32))
        print(json.dumps({"windows": len(windows)}))
        return
    # logits_all: llama-cpp-python 0.3 leaves `scores` zero without it (its greedy answer would be token 0 forever);
    # a decode step asks for its one row's logits either way
    llm = Llama(
        model_path=args.gguf,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=1024,
        logits_all=True,
        verbose=False,
    )
    if args.prompts_file:
        prompts = json.loads(Path(args.prompts_file).read_text())
        print(json.dumps({"answers": [greedy(llm, prompt, args.new_tokens)[0] for prompt in prompts]}))
        return
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    rates: list[float] = []
    tokens: list[int] = []
    for _ in range(args.repeats):  # the first warms up; the best of the rest is reported, as ours is
        tokens, seconds = greedy(llm, prompt, args.new_tokens)
        rates.append(args.new_tokens / seconds)
    print(json.dumps({"tok_s": max(rates[1:] or rates), "token_ids": tokens}))


if __name__ == "__main__":
    main()
