"""The static-shape verify pass and its CUDA graphs (shared/model/cuda_graphs.py, static_pass.py).

On the CPU: the buckets, the settings' resolution, and that a padded pass touches only its own sessions'
rows and the scratch slot. Where CUDA is present: the verifier's runner captures a graph per bucket, replays
it for chains, trees and several sessions, and gives the eager pass's states (closely: the static pass
attends row by row) and its greedy tokens; without CUDA that one test is skipped, saying why.
"""

from __future__ import annotations

import pytest
import torch

from services.verifier_cloud.kv_plan import KVPlan
from services.verifier_cloud.runner import ModelRunner, RunItem
from services.verifier_cloud.work import WorkKind
from shared.model.checkpoint import load_checkpoint
from shared.model.cuda_graphs import StaticPasses, parse_row_buckets, width_buckets
from shared.model.split import MiddleSubmodel
from shared.model.static_kv import StaticKVPool
from shared.specdec.verify_layout import VerifyLayout

M = 2
PREFILL, VERIFY = WorkKind.PREFILL, WorkKind.VERIFY


def test_buckets_and_settings():
    assert width_buckets(512) == (64, 128, 256, 512) and width_buckets(8192)[-1] == 8192
    assert width_buckets(100) == (64, 128)  # the capacity, rounded up to a multiple of CHUNK
    assert parse_row_buckets("1, 2,4") == (1, 2, 4)
    for bad in ("", "4,2", "0,1", "x"):
        with pytest.raises(ValueError):
            parse_row_buckets(bad)
    decide = KVPlan.decide
    assert decide("auto", "auto", "1,2", False, 1, 1) == KVPlan(False, False, (1, 2), 1, 1)  # the CPU default
    assert decide("auto", "auto", "1,2", True, 1, 1) == KVPlan(True, True, (1, 2), 1, 1)  # CUDA: graphs
    assert decide("auto", "off", "1", True, 1, 1).static is False
    assert decide("static", "off", "1", True, 1, 1) == KVPlan(True, False, (1,), 1, 1)
    assert decide("static", "auto", "1", False, 1, 1).graphs is False  # no CUDA: the eager packed pass
    with pytest.raises(ValueError, match="static"):
        decide("dynamic", "on", "1", False, 1, 1)


def test_a_padded_pass_writes_only_its_rows_and_the_scratch_slot(tiny_llama_dir):
    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    middle = MiddleSubmodel(checkpoint, M)
    pool = StaticKVPool.for_layers(middle, 512, 3)
    passes = StaticPasses(middle, pool, capture=False)
    first, second = pool.acquire(), pool.acquire()
    middle.forward_batch([(first, torch.randn(5, checkpoint.hidden_size))])
    before = [keys.clone() for keys in pool.keys]
    out = passes.forward_batch([(first, torch.randn(3, checkpoint.hidden_size))])  # 3 rows in the 4-row bucket
    assert passes.counts == {"static": 1} and out[0].shape == (3, checkpoint.hidden_size)
    assert first.length == 8 and second.length == 0
    for old, new in zip(before, pool.keys):
        assert torch.equal(old[first.slot, :, :5], new[first.slot, :, :5])  # committed rows untouched
        assert not torch.equal(old[first.slot, :, 5:8], new[first.slot, :, 5:8])  # its three new rows
        assert torch.equal(old[first.slot, :, 8:], new[first.slot, :, 8:])
        assert torch.equal(old[second.slot], new[second.slot])  # another session's slot: untouched
        assert torch.equal(old[2], new[2])  # the free slot too; only the scratch slot took the padding
    assert torch.isfinite(torch.stack([keys[pool.scratch] for keys in pool.keys])).all()


def _steps(runner: ModelRunner, hidden: int) -> list[torch.Tensor]:
    """Prefills (eager: past the largest bucket), then chains, a tree and its compaction, several sessions."""
    generator = torch.Generator().manual_seed(1)
    outputs = []

    def run(*items):
        for result in runner.run(items):
            assert result.error is None, result.error
            outputs.append(result.output)

    def rows(n):
        return torch.randn(n, hidden, generator=generator)

    for sid in (1, 2):
        runner.open(sid)
    run(RunItem(1, PREFILL, 0, rows(40)), RunItem(2, PREFILL, 0, rows(70)))
    for _ in range(2):  # the second round replays the graphs the first captured
        run(RunItem(1, VERIFY, 40, rows(1)))
        run(RunItem(1, VERIFY, 40, rows(4)), RunItem(2, VERIFY, 70, rows(3)))
        run(RunItem(2, VERIFY, 70, rows(5), layout=VerifyLayout((0, 0, 1, 2))))
        run(RunItem(2, VERIFY, 73, rows(2), layout=VerifyLayout((0,), kept=(71, 73))))
    return outputs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need an NVIDIA GPU; this machine has no CUDA")
def test_the_runner_replays_captured_graphs_with_the_eager_states(tiny_llama_dir):
    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    checkpoint.model.to("cuda")
    middle = MiddleSubmodel(checkpoint, M)
    context = checkpoint.config.max_position_embeddings
    eager = ModelRunner(middle, context)  # the dynamic layout, eager passes
    plan = KVPlan.decide("auto", "auto", "1,2,4,8,16,32", True, 2**30, 4)
    graphed = ModelRunner(middle, context, None, *plan.runner_parts(middle, context))
    assert graphed.passes is not None and graphed.passes.capture
    expected, got = _steps(eager, checkpoint.hidden_size), _steps(graphed, checkpoint.hidden_size)
    counts = graphed.passes.counts
    assert counts["eager"] == 1 and counts["graph"] == 8  # the prefill; every verify from a graph
    # every bucket up to the 512-row capacity was captured when the runner was built, none since
    assert len(graphed.passes.graphs) == 6 * 4
    head = checkpoint.model.lm_head.cpu()
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(head(a).argmax(-1), head(b).argmax(-1))  # the same greedy tokens
