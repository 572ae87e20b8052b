"""Greedy decode tokens/s of llama.cpp on a GGUF, for `make bench-engine`.

Runs in its own virtual environment (.venv-llama, llama-cpp-python built from source), so it
imports nothing from this project: `python llama_cpp_decode.py GGUF --threads N --prompt-ids
1,2,3 --new-tokens 64` prints one JSON line {"tok_s": ..., "token_ids": [...]}.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    from llama_cpp import Llama

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-ids", required=True, help="comma-separated token ids (the same prompt as ours)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    llm = Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=1024, verbose=False)
    rates, tokens = [], []
    for _ in range(args.repeats):  # the first warms up; the best of the rest is reported, as ours is
        llm.reset()
        llm.eval(prompt)
        tokens = []
        started = time.perf_counter()
        for _ in range(args.new_tokens):
            token = int(llm.scores[llm.n_tokens - 1].argmax())  # greedy on the last position's logits
            tokens.append(token)
            llm.eval([token])
        rates.append(args.new_tokens / (time.perf_counter() - started))
    print(json.dumps({"tok_s": max(rates[1:] or rates), "token_ids": tokens}))


if __name__ == "__main__":
    main()
