"""What the load generator sends: prompts whose token lengths follow HAT's Table 3.

The demo model cannot read SpecBench or CNN/DM, so we keep their *shape*: prompt
lengths are drawn from a distribution fitted to the paper's mean and std and cut
from the held-out split of the demo corpus (text the model never trained on),
measured in the model's own tokens. A moment-matched gamma fits the published
P90 better than a lognormal for both sets (SpecBench: 859 vs 744, target 891;
CNN/DM: 1723 vs 1691, target 1772), so it is the default. Lengths are clipped to
[16, context_limit - max_new_tokens] so every request fits the model; the stats
actually achieved are reported next to the targets.

A JSONL file of {"prompt": ..., "max_tokens": optional} can be used instead.
Each request carries a round-robin `device_hint` (in HAT every device generates
its own requests); whether it is sent is the runner's business.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)

MIN_PROMPT_TOKENS = 16
WORKLOAD_STREAM = 2  # RNG stream id of prompt lengths (arrivals use 1); the simulator draws the same lengths
_FILE_SEPARATOR = "\n\n"


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer we use (a fast tokenizer, for offsets)."""

    def __call__(self, text: str, **kw: Any) -> Any: ...


@dataclass(frozen=True)
class LengthSpec:
    """Published prompt-length statistics of one benchmark (HAT Table 3)."""

    name: str
    mean: float
    p90: float
    std: float


SPECBENCH = LengthSpec("specbench", 351.2, 891.0, 397.3)
CNNDM = LengthSpec("cnndm", 1036.6, 1772.0, 511.8)
BUILTIN = {s.name: s for s in (SPECBENCH, CNNDM)}


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    prompt: str
    prompt_tokens: int | None  # by our tokenizer; the server's usage count wins when it reports one
    max_tokens: int
    device_hint: int


@dataclass
class Workload:
    name: str
    requests: list[WorkloadRequest]
    stats: dict[str, Any]  # target vs achieved prompt-length stats, for results.json


def load_tokenizer(path: str | Path) -> Any:
    """The model's tokenizer via transformers (slow import: call once, pass it around)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def context_limit_of(path: str | Path, default: int = 2048) -> int:
    """The model's context window: config.json `max_position_embeddings`, else `default`."""
    config = Path(path) / "config.json"
    try:
        value = json.loads(config.read_text()).get("max_position_embeddings")
    except (OSError, ValueError) as exc:
        log.warning("cannot read %s (%s); assuming a %d-token context", config, exc, default)
        return default
    return int(value) if isinstance(value, int) and value > 0 else default


def fit_lengths(
    spec: LengthSpec, n: int, rng: np.random.Generator, low: int, high: int, dist: str = "gamma"
) -> np.ndarray:
    """`n` integer lengths from a gamma or lognormal matched to spec.mean/std, clipped to [low, high]."""
    if low > high:
        raise ValueError(f"no room for a prompt: need {low} <= {high} (context too small for max_new_tokens?)")
    cv2 = (spec.std / spec.mean) ** 2
    if dist == "gamma":
        raw = rng.gamma(shape=1.0 / cv2, scale=spec.mean * cv2, size=n)
    elif dist == "lognormal":
        sigma2 = math.log1p(cv2)
        raw = rng.lognormal(mean=math.log(spec.mean) - sigma2 / 2, sigma=math.sqrt(sigma2), size=n)
    else:
        raise ValueError(f"unknown length distribution {dist!r} (gamma or lognormal)")
    return np.clip(np.rint(raw), low, high).astype(int)


def length_stats(lengths: list[int] | np.ndarray) -> dict[str, float | int | None]:
    xs = np.asarray(lengths, dtype=float)
    if xs.size == 0:
        return {"count": 0, "mean": None, "p90": None, "std": None, "min": None, "max": None}
    return {
        "count": int(xs.size),
        "mean": float(xs.mean()),
        "p90": float(np.percentile(xs, 90)),
        "std": float(xs.std()),
        "min": int(xs.min()),
        "max": int(xs.max()),
    }


class HeldOutText:
    """The held-out corpus as one token stream with character offsets, to cut exact-length prompts."""

    def __init__(self, tokenizer: Tokenizer, texts: list[str] | None = None) -> None:
        if texts is None:
            from tophatctl.demo_model.corpus import held_out_files

            texts = [f.text for f in held_out_files()]
        self.text = _FILE_SEPARATOR.join(texts)
        enc = tokenizer(self.text, return_offsets_mapping=True, add_special_tokens=False, verbose=False)
        self.offsets: list[tuple[int, int]] = [tuple(o) for o in enc["offset_mapping"]]
        # Prompts start at a line start, as a user would paste them.
        self.line_starts = [i for i, (s, _) in enumerate(self.offsets) if s == 0 or self.text[s - 1] == "\n"]
        self.tokenizer = tokenizer
        log.info("held-out text: %d tokens, %d line starts", len(self.offsets), len(self.line_starts))

    def __len__(self) -> int:
        return len(self.offsets)

    def cut(self, length: int, rng: np.random.Generator) -> tuple[str, int]:
        """A prompt of about `length` tokens from a random line start; (text, re-encoded length)."""
        if length > len(self.offsets):
            raise ValueError(f"held-out text has only {len(self.offsets)} tokens, asked for {length}")
        last_start = len(self.offsets) - length
        pos = bisect.bisect_right(self.line_starts, last_start)
        start = self.line_starts[int(rng.integers(0, pos))] if pos else int(rng.integers(0, last_start + 1))
        # Re-encoding can merge or split tokens at the edges: grow, then trim, to hit the budget.
        target, end = length, start + length
        text, count = self._span(start, end)
        while count < target and end < len(self.offsets):
            end += 1
            text, count = self._span(start, end)
        while count > target and end - start > 1:
            end -= 1
            text, count = self._span(start, end)
        return text, count

    def _span(self, start: int, end: int) -> tuple[str, int]:
        text = self.text[self.offsets[start][0] : self.offsets[end - 1][1]]
        return text, self.count(text)

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def synthetic_workload(
    spec: LengthSpec,
    num_requests: int,
    *,
    tokenizer: Tokenizer,
    max_new_tokens: int,
    context_limit: int,
    seed: int = 0,
    num_devices: int = 1,
    dist: str = "gamma",
    held_out: HeldOutText | None = None,
) -> Workload:
    """`num_requests` prompts with lengths fitted to `spec` (deterministic for a seed)."""
    rng = np.random.default_rng([seed, WORKLOAD_STREAM])
    high = context_limit - max_new_tokens
    held_out = held_out or HeldOutText(tokenizer)
    lengths = fit_lengths(spec, num_requests, rng, MIN_PROMPT_TOKENS, high, dist)
    requests, counts = [], []
    for i, length in enumerate(lengths):
        prompt, count = held_out.cut(int(length), rng)
        requests.append(WorkloadRequest(i, prompt, count, max_new_tokens, i % max(1, num_devices)))
        counts.append(count)
    achieved = length_stats(counts)
    stats = {"target": asdict(spec), "distribution": dist, "clip": [MIN_PROMPT_TOKENS, high], "achieved": achieved}
    log.info(
        "%s workload: %d prompts, mean %.1f P90 %.1f std %.1f tokens (target %.1f / %.0f / %.1f)",
        spec.name,
        len(requests),
        achieved["mean"] or 0,
        achieved["p90"] or 0,
        achieved["std"] or 0,
        spec.mean,
        spec.p90,
        spec.std,
    )
    return Workload(spec.name, requests, stats)


def file_workload(
    path: str | Path,
    num_requests: int,
    *,
    max_new_tokens: int,
    tokenizer: Tokenizer | None = None,
    num_devices: int = 1,
) -> Workload:
    """Requests from a JSONL file of {"prompt": str, "max_tokens": int?}, cycled in file order if too few."""
    entries = _read_jsonl(Path(path))
    requests = []
    for i in range(num_requests):
        entry = entries[i % len(entries)]
        count = (
            len(tokenizer(entry["prompt"], add_special_tokens=False, verbose=False)["input_ids"])
            if tokenizer is not None
            else None
        )
        requests.append(
            WorkloadRequest(
                i, entry["prompt"], count, int(entry.get("max_tokens") or max_new_tokens), i % max(1, num_devices)
            )
        )
    lengths = [r.prompt_tokens for r in requests if r.prompt_tokens is not None]
    return Workload(
        Path(path).name,
        requests,
        {"target": None, "source": str(path), "entries": len(entries), "achieved": length_stats(lengths)},
    )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    entries = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{lineno}: not JSON ({exc})") from exc
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"]:
            raise ValueError(f"{path}:{lineno}: need an object with a non-empty string 'prompt'")
        max_tokens = entry.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"{path}:{lineno}: 'max_tokens' must be a positive integer")
        entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: no requests")
    return entries
