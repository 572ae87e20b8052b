"""`make bench-engine`'s bookkeeping (the timings themselves are the benchmark's, never asserted)."""

from __future__ import annotations

from loadgen.bench_engine import gguf_pass_bytes, print_table
from tophatctl.models import smollm2_gguf_path


def test_gguf_pass_bytes_counts_every_tensor_once():
    path = smollm2_gguf_path()
    total = gguf_pass_bytes(path)
    # the Q4_1 layers and the Q8_0 embedding table (30,081,024 bytes), less than the file with its metadata
    assert 30_081_024 < total < path.stat().st_size
    assert total > 90e6


def test_table_puts_every_engine_against_its_own_floor(capsys):
    results = {
        "bandwidth_gb_s": {1: 10.0},
        "runs": [
            {
                "dtype": "int4",
                "threads": 1,
                "weight_mb": 95.0,
                "decode_tok_s": 30.0,
                "decode_floor_tok_s": 105.0,
                "decode8_tok_s": 90.0,
                "decode8_floor_tok_s": 840.0,
                "verify_ms": {1: 20.0},
                "verify_floor_ms": 2.0,
            },
            {
                "dtype": "llama.cpp Q4_1",
                "threads": 1,
                "decode_tok_s": 50.0,
                "weight_mb": 96.6,
                "decode_floor_tok_s": 103.5,
            },
        ],
        "quality": {},
    }
    print_table(results)
    out = capsys.readouterr().out
    assert "2.1x its floor of 103.5 tok/s" in out  # llama.cpp: 103.5 / 50
    assert "| int4 | 1 | 95 | 30.0 (105.0, 3.5x floor, 0.60x) |" in out


def test_the_quality_scores_count_agreement_kl_and_perplexity_against_the_reference():
    import math

    import torch

    from loadgen.engine_quality import Scores, until_eos

    window = [3, 1, 2, 0]
    reference = torch.tensor([[0.0, 2.0, 1.0, 0.0], [0.0, 0.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [0.0] * 4])
    same = Scores()
    same.add(reference, reference.clone(), window)
    assert same.summary()["same_top"] == 1.0 and same.summary()["mean_kl"] == 0.0 and same.positions == 3
    nll = -sum(float(reference[i].double().log_softmax(-1)[window[i + 1]]) for i in range(3)) / 3
    assert math.isclose(same.summary()["perplexity"], math.exp(nll), rel_tol=1e-9)
    other = Scores()
    flipped = reference.clone()
    flipped[0] = torch.tensor([0.0, 1.0, 2.0, 0.0])  # another top token at the first position
    other.add(reference, flipped, window)
    assert math.isclose(other.summary()["same_top"], 2 / 3) and other.summary()["mean_kl"] > 0
    assert until_eos([5, 6, 2, 7], eos=2) == [5, 6, 2] and until_eos([5, 6], eos=2) == [5, 6]
