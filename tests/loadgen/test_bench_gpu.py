"""`make bench-gpu` (loadgen/bench_gpu.py), run on the CPU with the demo model and small sizes: every stage
measures something real, a failing stage is written down without stopping the others, and the JSON says
what ran where."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loadgen import bench_gpu, gpu_checks

SMALL = [
    "--model",
    "demo",
    "--device",
    "cpu",
    "--dtype",
    "f32",
    "--sessions",
    "1,2",
    "--hf-sessions",
    "1,2",
    "--rows",
    "1,4",
    "--new-tokens",
    "4",
    "--greedy-prompts",
    "2",
    "--greedy-tokens",
    "12",
    "--context",
    "16",
    "--repeats",
    "2",
    "--threads",
    "1",
]


def bench_gpu_main(args: list[str]) -> dict:
    """`tophat bench gpu ARGS` (its --out among them) through the command line; the results JSON it wrote."""
    from typer.testing import CliRunner

    from tophat.cli import app

    result = CliRunner().invoke(app, ["bench", "gpu", *args])
    print(result.output)
    assert result.exit_code in (0, 1), result.output
    return json.loads(Path(args[args.index("--out") + 1]).read_text())


@pytest.fixture(autouse=True)
def one_thread():
    """Small models on a shared CPU: one torch thread is faster than two that wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_stage_runs_on_the_demo_model_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    results = bench_gpu_main([*SMALL, "--out", str(out)])
    stages = results["stages"]
    assert list(stages) == list(bench_gpu.STAGES)
    assert {name: stage["status"] for name, stage in stages.items()} == {name: "ok" for name in bench_gpu.STAGES}
    assert results["finished"] and results["meta"]["placement"] == "cpu float32"
    assert results["meta"]["weights"] == "checkpoint" and results["meta"]["layers"] == 8
    greedy = stages["greedy"]
    assert greedy["all_equal"] and greedy["equal"] == greedy["prompts"] == 2 and greedy["mismatches"] == []
    assert greedy["mean_accept_length"] >= 1.0 and greedy["hat_in_process_tok_s"] > 0
    assert set(stages["decode"]["tok_s"]) == {"1", "2"} and min(stages["decode"]["tok_s"].values()) > 0
    assert set(stages["transformers"]["tok_s"]) == {"1", "2"} and min(stages["transformers"]["tok_s"].values()) > 0
    assert stages["verify"]["middle_layers"] == 6 and set(stages["verify"]["ms"]) == {"1", "4"}
    assert min(stages["verify"]["ms"].values()) > 0
    assert stages["cuda_graphs"]["cuda_graphs"].startswith("not attempted")
    served = stages["served_graphs"]  # on the CPU the static-shape pass runs eagerly beside the eager pass
    assert served["path"] == "static_eager" and served["counts"]["static"] > 0
    for rows in ("1", "4"):
        assert served[rows]["static_eager_ms"] > 0 and served[rows]["eager_ms"] > 0
        assert served[rows]["max_abs_diff"] < 1e-3
    table = capsys.readouterr().out
    assert "| greedy HAT == unsplit (2 prompts x 12 tokens) | 2/2 equal" in table
    assert "| unsplit decode tok/s, 1 / 2 sessions |" in table


def test_a_failing_stage_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no transformers today")

    monkeypatch.setattr(bench_gpu, "transformers_rate", broken)
    out = tmp_path / "gpu.json"
    bench_gpu_main([*SMALL, "--stages", "transformers,decode", "--out", str(out)])
    stages = json.loads(out.read_text())["stages"]
    assert stages["transformers"]["status"] == "error"
    assert stages["transformers"]["error"] == "RuntimeError: no transformers today"
    assert stages["decode"]["status"] == "ok" and stages["decode"]["tok_s"]["2"] > 0
    assert stages["greedy"]["status"] == "skipped: not selected"


def test_a_spent_time_budget_starts_nothing_but_still_writes_the_json(tmp_path):
    out = tmp_path / "gpu.json"
    results = bench_gpu_main([*SMALL, "--time-budget-s", "0", "--out", str(out)])
    assert all(stage["status"].startswith("skipped: time budget") for stage in results["stages"].values())
    assert json.loads(out.read_text())["finished"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run on a machine without CUDA")
def test_without_cuda_placement_fails_and_every_stage_says_why(tmp_path):
    results = bench_gpu_main([*SMALL, "--device", "cuda", "--dtype", "bf16", "--out", str(tmp_path / "gpu.json")])
    assert results["stages"]["placement"]["status"] == "error"
    assert "CudaUnavailableError" in results["stages"]["placement"]["error"]
    others = [stage["status"] for name, stage in results["stages"].items() if name != "placement"]
    assert others == ["skipped: no model (placement failed)"] * (len(bench_gpu.STAGES) - 1)


def test_random_weights_keep_the_checkpoint_shape_and_hat_stays_exact():
    checkpoint, _, info = gpu_checks.place_model("demo", "cpu", "f32", "random")
    assert info["weights"] == "random" and info["weights_source"].startswith("random init")
    assert (checkpoint.num_layers, checkpoint.hidden_size, checkpoint.vocab_size) == (8, 256, 8192)
    prompts, _ = gpu_checks.prompts_for(checkpoint, 1)
    result = gpu_checks.greedy_check(checkpoint, 2, None, prompts, 8)
    assert result["equal"] == result["prompts"] == 1


def test_smollm2_shape_without_its_config(tmp_path, monkeypatch):
    """On a machine with only the committed adapter (the imported weights and config are git-ignored), random
    weights are built in SmolLM2-135M's shape; where the imported config is there, it is the same config."""
    imported = gpu_checks.MODELS_DIR / "smollm2" / "config.json"
    monkeypatch.setattr(gpu_checks, "MODELS_DIR", tmp_path)
    (tmp_path / "smollm2").mkdir()
    config = gpu_checks.model_config(tmp_path / "smollm2")
    shape = (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads)
    assert shape == (30, 576, 9, 3) and config.tie_word_embeddings and config.vocab_size == 49152
    if imported.is_file():
        expected = gpu_checks.model_config(imported.parent).to_dict()
        assert config.to_dict() == expected
    with pytest.raises(FileNotFoundError):
        gpu_checks.model_config(tmp_path)


def test_same_greedy_allows_only_an_end_of_sequence_cut():
    assert gpu_checks.same_greedy([1, 2, 3], [1, 2, 3], eos=0)
    assert gpu_checks.same_greedy([1, 0], [1, 0, 5], eos=0)
    assert not gpu_checks.same_greedy([1, 2], [1, 2, 3], eos=0)
    assert not gpu_checks.same_greedy([1, 4, 3], [1, 2, 3], eos=0)
    assert gpu_checks.first_difference([1, 4, 3], [1, 2, 3]) == 1
    assert gpu_checks.first_difference([1, 2], [1, 2, 3]) == 2


def test_a_mismatch_is_reported_with_where_and_how_close_the_tie_was(monkeypatch):
    """A reference that differs from HAT's answer (here: altered on purpose) is counted, located, and diagnosed
    with the unsplit model's top-2 margin there and the rank of HAT's token."""
    checkpoint, _, _ = gpu_checks.place_model("demo", "cpu", "f32", "checkpoint")
    decode_rate = bench_gpu.decode_rate

    def altered(*args, **kwargs):
        rate, tokens = decode_rate(*args, **kwargs)
        tokens[0][3] = (tokens[0][3] + 1) % checkpoint.vocab_size
        return rate, tokens

    monkeypatch.setattr(gpu_checks, "decode_rate", altered)
    prompts, _ = gpu_checks.prompts_for(checkpoint, 1)
    result = gpu_checks.greedy_check(checkpoint, 2, None, prompts, 8)
    assert result["equal"] == 0 and not result["all_equal"]
    [mismatch] = result["mismatches"]
    assert mismatch["first_difference"] == 3 and mismatch["top2_margin"] >= 0
    assert mismatch["hat_token_rank"] == 0  # HAT's token is the unsplit model's argmax: the reference was altered
    assert mismatch["reference_token"] != mismatch["hat_token"]
