"""Edge SD cost model (paper 001): FLOPs per pass (eqs. 11-14), draft memory (eqs. 9-10), the
runtime model T(b, F) = c1*F*b + c2 (eq. 17) and its fit; speculation length (eqs. 7-8, 33)."""

from __future__ import annotations

import math
import random

import pytest

from shared.edge_sd.runtime import (
    ModelShape,
    RuntimeFitError,
    RuntimeModel,
    batch_draft_memory,
    draft_pass_flops,
    fit_runtime,
    verify_step_flops,
)
from shared.edge_sd.speculation import (
    choose_speculation_length,
    decoding_steps,
    expected_tokens_per_step,
)

LLAMA_68M = ModelShape(layers=2, hidden=768, ffn=3072)  # Table I
LLAMA_7B = ModelShape(layers=32, hidden=4096, ffn=11008)


@pytest.mark.parametrize("bad", [(0, 8, 8), (2, -1, 8), (2, 8, 1.5), (True, 8, 8)])
def test_model_shape_is_checked(bad):
    with pytest.raises(ValueError):
        ModelShape(*bad)


def test_weight_and_kv_bytes_follow_eqs_9_and_10():
    j, h1, h2 = 32, 4096, 11008
    assert LLAMA_7B.weight_bytes == j * (8 * h1**2 + 4 * h1 * h2)  # eq. 9, FP16 bytes
    assert LLAMA_7B.kv_bytes_per_token == 4 * j * h1
    # Eq. 10: every task is charged the batch's padded input and max output.
    need = batch_draft_memory(LLAMA_68M, [10, 300, 40], [5, 7, 100])
    assert need == LLAMA_68M.weight_bytes + 3 * 4 * 2 * 768 * (300 + 100)


def test_prefill_and_decode_flops_expand_eqs_11_and_12():
    j, h1, h2 = 2, 768, 3072
    i_m = 137
    assert LLAMA_68M.prefill_flops(i_m) == j * (8 * i_m * h1**2 + 4 * i_m**2 * h1 + 4 * i_m * h1 * h2)
    kv = 250
    assert LLAMA_68M.decode_flops(kv) == j * (8 * h1**2 + 4 * (kv + 1) * h1 + 4 * h1 * h2)


def test_draft_pass_flops_eq_13_kv_lengths():
    i_m, big_l = 100, 2.5
    assert draft_pass_flops(LLAMA_68M, i_m, step=1, draft_pass=1, tokens_per_step=big_l) == LLAMA_68M.prefill_flops(i_m)
    # Step 1, pass 2: the prompt is cached, the first draft is the new token: KV = I_m.
    assert draft_pass_flops(LLAMA_68M, i_m, 1, 2, big_l) == LLAMA_68M.decode_flops(i_m)
    # Step 3, pass 2: KV = I_m + ((n-1)L - 1) + (i-1) = 100 + 4 + 1.
    assert draft_pass_flops(LLAMA_68M, i_m, 3, 2, big_l) == LLAMA_68M.decode_flops(105.0)


def test_verify_step_flops_eq_14():
    j, h1, h2 = 32, 4096, 11008
    i_m, l, big_l = 64, 4, 3.0
    assert verify_step_flops(LLAMA_7B, i_m, 1, l, big_l) == 4 * j * h1 * (i_m + l) * (2 * h1 + i_m + l + h2)
    kv = i_m + 2 * big_l - 1  # step 3
    assert verify_step_flops(LLAMA_7B, i_m, 3, l, big_l) == 4 * j * h1 * (1 + l) * (2 * h1 + kv + l + 1 + h2)


def test_runtime_model_eq_17_and_checks():
    model = RuntimeModel(c1=2e-14, c2=0.01)
    assert model.seconds(4, 1e12) == pytest.approx(2e-14 * 1e12 * 4 + 0.01)
    with pytest.raises(ValueError):
        RuntimeModel(c1=-1e-14, c2=0.0)
    with pytest.raises(ValueError):
        RuntimeModel(c1=1e-14, c2=math.nan)


def _samples(c1, c2, noise_secs, seed):
    rng = random.Random(seed)
    rows = []
    for batch in (1, 2, 4, 8, 16):
        for flops in (1e11, 5e11, 2e12, 8e12):
            rows.append((batch, flops, c1 * flops * batch + c2 + rng.gauss(0, noise_secs)))
    return rows


def test_fit_recovers_noiseless_coefficients():
    fitted = fit_runtime(_samples(4.11e-13, 0.56e-3, 0.0, seed=0))  # Table II, draft GPU
    assert fitted.c1 == pytest.approx(4.11e-13, rel=1e-9)
    assert fitted.c2 == pytest.approx(0.56e-3, rel=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_fit_recovers_noisy_coefficients(seed):
    # Table II, verify GPU; 1 ms of timing noise on passes of 2 ms .. 2.7 s.
    fitted = fit_runtime(_samples(2.08e-14, 1.28e-2, 1e-3, seed=seed))
    assert fitted.c1 == pytest.approx(2.08e-14, rel=0.005)
    assert fitted.c2 == pytest.approx(1.28e-2, abs=1e-3)


def test_fit_clamps_a_negative_intercept_to_zero():
    fitted = fit_runtime([(1, 1e12, 0.9), (1, 2e12, 2.0), (1, 3e12, 3.1)])
    assert fitted.c2 == 0.0
    assert fitted.c1 == pytest.approx((0.9 * 1 + 2.0 * 2 + 3.1 * 3) / (1 + 4 + 9) / 1e12)


@pytest.mark.parametrize(
    "rows",
    [
        [],
        [(1, 1e12, 0.1)],
        [(1, 2e12, 0.1), (2, 1e12, 0.2)],  # same F*b twice: one distinct point
        [(1, 1e12, 0.3), (2, 1e12, 0.1)],  # slower with less work: c1 <= 0
        [(1, 1e12, math.nan), (2, 1e12, 0.1)],
    ],
)
def test_fit_refuses_degenerate_samples(rows):
    with pytest.raises(RuntimeFitError):
        fit_runtime(rows)


def test_expected_tokens_eq_7():
    assert expected_tokens_per_step(0.0, 5) == 1.0
    assert expected_tokens_per_step(0.5, 1) == 1.5
    assert expected_tokens_per_step(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert expected_tokens_per_step(1.0, 6) == 7.0
    assert expected_tokens_per_step(1 - 1e-9, 6) == pytest.approx(7.0, rel=1e-6)  # limit is continuous


@pytest.mark.parametrize("alpha", [-0.1, 1.1, math.nan, True])
def test_expected_tokens_refuses_bad_alpha(alpha):
    with pytest.raises(ValueError):
        expected_tokens_per_step(alpha, 3)


def test_decoding_steps_eq_8():
    assert decoding_steps(3, 1.5) == 2  # exact ratio is not rounded up by float error
    assert decoding_steps(4, 1.5) == 3
    assert decoding_steps(1, 4.0) == 1
    assert decoding_steps(2048, expected_tokens_per_step(0.8, 4)) == math.ceil(2048 / ((1 - 0.8**5) / 0.2))
    with pytest.raises(ValueError):
        decoding_steps(0, 2.0)


def _single_task_latency(alpha, output_len, draft_secs, verify_secs):
    """n(l) steps, each l draft passes then one verification: interior optimum in l."""

    def latency(l):
        return decoding_steps(output_len, expected_tokens_per_step(alpha, l)) * (l * draft_secs + verify_secs)

    return latency


def test_choose_speculation_length_finds_an_interior_optimum():
    latency = _single_task_latency(0.8, 1000, draft_secs=0.01, verify_secs=0.05)
    chosen, best = choose_speculation_length(0.8, 15, latency)
    values = [latency(l) for l in range(1, 16)]
    assert best == min(values) and chosen == values.index(min(values)) + 1
    assert 1 < chosen < 15  # neither end of the range
    assert best < latency(1) and best < latency(15)


def test_choose_speculation_length_ties_and_infeasible():
    assert choose_speculation_length(0.5, 5, lambda l: 3.0) == (1, 3.0)
    assert choose_speculation_length(0.5, 5, lambda l: math.inf if l < 4 else 10.0 - l) == (5, 5.0)
    with pytest.raises(ValueError):
        choose_speculation_length(0.5, 5, lambda l: math.inf)
    with pytest.raises(ValueError):
        choose_speculation_length(1.5, 5, lambda l: 1.0)
