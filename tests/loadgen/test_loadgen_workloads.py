"""Load-generator workloads: HAT Table 3 length fits, prompts cut from the held-out corpus
with the demo model's real tokenizer, and JSONL files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loadgen import workloads as wl

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
needs_demo = pytest.mark.skipif(not (DEMO / "tokenizer.json").exists(), reason="models/demo not built")


@pytest.mark.parametrize("spec", [wl.SPECBENCH, wl.CNNDM])
@pytest.mark.parametrize("dist", ["gamma", "lognormal"])
def test_length_fit_matches_mean_and_std(spec: wl.LengthSpec, dist: str) -> None:
    lengths = wl.fit_lengths(spec, 200_000, np.random.default_rng(0), 1, 10**7, dist)
    assert lengths.mean() == pytest.approx(spec.mean, rel=0.02)
    assert lengths.std() == pytest.approx(spec.std, rel=0.04)
    if dist == "gamma":  # the default fit also lands near the published P90
        assert np.percentile(lengths, 90) == pytest.approx(spec.p90, rel=0.05)


def test_length_fit_clips_and_rejects_bad_input() -> None:
    lengths = wl.fit_lengths(wl.CNNDM, 5_000, np.random.default_rng(1), 16, 1920)
    assert lengths.min() >= 16 and lengths.max() == 1920
    with pytest.raises(ValueError):
        wl.fit_lengths(wl.CNNDM, 5, np.random.default_rng(1), 16, 8)
    with pytest.raises(ValueError):
        wl.fit_lengths(wl.CNNDM, 5, np.random.default_rng(1), 16, 100, "pareto")


@pytest.fixture(scope="module")
def held_out() -> wl.HeldOutText:
    if not (DEMO / "tokenizer.json").exists():
        pytest.skip("models/demo not built")
    return wl.HeldOutText(wl.load_tokenizer(DEMO))


@needs_demo
def test_context_limit_comes_from_the_model_config(tmp_path: Path) -> None:
    assert wl.context_limit_of(DEMO) == 2048
    assert wl.context_limit_of(tmp_path, default=512) == 512


@needs_demo
@pytest.mark.parametrize("spec", [wl.SPECBENCH, wl.CNNDM])
def test_synthetic_workload_follows_table_3(held_out: wl.HeldOutText, spec: wl.LengthSpec) -> None:
    work = wl.synthetic_workload(
        spec,
        300,
        tokenizer=held_out.tokenizer,
        max_new_tokens=128,
        context_limit=2048,
        seed=4,
        num_devices=3,
        held_out=held_out,
    )
    lengths = [r.prompt_tokens for r in work.requests]
    assert min(lengths) >= 1 and max(lengths) <= 2048 - 128
    achieved = work.stats["achieved"]
    assert achieved["count"] == 300
    assert achieved["mean"] == pytest.approx(spec.mean, rel=0.15)  # 300 samples, clipped at 1920
    assert work.stats["target"]["p90"] == spec.p90
    assert [r.device_hint for r in work.requests[:5]] == [0, 1, 2, 0, 1]
    assert all(r.max_tokens == 128 for r in work.requests)
    for r in work.requests[:20]:  # real held-out text, measured in the model's own tokens
        assert r.prompt in held_out.text
        assert held_out.count(r.prompt) == r.prompt_tokens


@needs_demo
def test_synthetic_workload_is_deterministic_per_seed(held_out: wl.HeldOutText) -> None:
    def prompts(seed: int) -> list[str]:
        return [
            r.prompt
            for r in wl.synthetic_workload(
                wl.SPECBENCH,
                20,
                tokenizer=held_out.tokenizer,
                max_new_tokens=128,
                context_limit=2048,
                seed=seed,
                held_out=held_out,
            ).requests
        ]

    assert prompts(1) == prompts(1)
    assert prompts(1) != prompts(2)


def test_file_workload_cycles_and_honours_max_tokens(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(
        json.dumps({"prompt": "def f():"}) + "\n\n" + json.dumps({"prompt": "x = 1", "max_tokens": 7}) + "\n"
    )
    work = wl.file_workload(path, 5, max_new_tokens=32, num_devices=2)
    assert [r.prompt for r in work.requests] == ["def f():", "x = 1"] * 2 + ["def f():"]
    assert [r.max_tokens for r in work.requests] == [32, 7, 32, 7, 32]
    assert [r.device_hint for r in work.requests] == [0, 1, 0, 1, 0]
    assert work.requests[0].prompt_tokens is None  # no tokenizer given: the server's usage will tell


@pytest.mark.parametrize("content", ["", "not json\n", '{"text": "x"}\n', '{"prompt": "x", "max_tokens": 0}\n'])
def test_file_workload_rejects_bad_files(tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError):
        wl.file_workload(path, 1, max_new_tokens=8)
