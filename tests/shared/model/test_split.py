"""The split halves equal the whole (Petals-style), for every chunking and after rollbacks."""

from __future__ import annotations

import random

import pytest
import torch

from shared.model.checkpoint import ModelLoadError, load_checkpoint
from shared.model.kv_cache import KVCacheError
from shared.model.split import MiddleSubmodel, SplitError, SplitModel, stage_ranges

TOLERANCE = 1e-4


def full_logits(checkpoint, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return checkpoint.model(input_ids=torch.tensor([ids])).logits[0].float()  # [S, V]


def split_logits(split: SplitModel, ids: list[int], chunk_sizes: list[int]) -> torch.Tensor:
    device_cache, cloud_cache = split.input.new_cache(), split.middle.new_cache()
    outputs, start = [], 0
    for size in chunk_sizes:
        shallow = split.input(torch.tensor(ids[start : start + size]), device_cache)
        deep = split.middle.forward_batch([(cloud_cache, shallow)])[0]
        outputs.append(split.output(deep))
        start += size
    return torch.cat(outputs)


def random_chunking(rng: random.Random, n: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, n), rng.randint(0, min(4, n - 1))))
    bounds = [0, *cuts, n]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("split_layers", [1, 2, 4])
def test_split_equals_unsplit_for_any_chunking(tiny_checkpoint, split_layers):
    split = SplitModel.from_checkpoint(tiny_checkpoint, split_layers)
    rng = random.Random(split_layers)
    for _ in range(4):
        ids = [rng.randrange(tiny_checkpoint.vocab_size) for _ in range(rng.randint(2, 40))]
        expected = full_logits(tiny_checkpoint, ids)
        for chunks in ([len(ids)], [1] * len(ids), random_chunking(rng, len(ids))):
            got = split_logits(split, ids, chunks)
            assert (got - expected).abs().max() <= TOLERANCE, chunks


def test_demo_model_split_equals_unsplit(demo_checkpoint):
    split = SplitModel.from_checkpoint(demo_checkpoint, 2)
    rng = random.Random(7)
    ids = [rng.randrange(demo_checkpoint.vocab_size) for _ in range(60)]
    expected = full_logits(demo_checkpoint, ids)
    for chunks in ([60], [16, 16, 16, 12], random_chunking(rng, 60)):
        assert (split_logits(split, ids, chunks) - expected).abs().max() <= TOLERANCE


def test_rollback_then_reappend_equals_never_appended(tiny_checkpoint):
    split = SplitModel.from_checkpoint(tiny_checkpoint, 2)
    rng = random.Random(3)
    ids = [rng.randrange(tiny_checkpoint.vocab_size) for _ in range(30)]
    expected = full_logits(tiny_checkpoint, ids)
    device_cache, cloud_cache = split.input.new_cache(), split.middle.new_cache()

    def run(chunk: list[int]) -> torch.Tensor:
        shallow = split.input(torch.tensor(chunk), device_cache)
        return split.output(split.middle.forward_batch([(cloud_cache, shallow)])[0])

    run(ids[:20])
    for depth in (1, 5, 3, 12):  # repeated rollbacks of various depths, with garbage appended in between
        garbage = [rng.randrange(tiny_checkpoint.vocab_size) for _ in range(depth + 2)]
        run(garbage)
        device_cache.truncate(20)
        cloud_cache.truncate(20)
    got = run(ids[20:])
    assert (got - expected[20:]).abs().max() <= TOLERANCE
    device_cache.truncate(10)
    cloud_cache.truncate(10)
    assert (run(ids[10:]) - expected[10:]).abs().max() <= TOLERANCE


def test_incremental_decode_equals_full_recompute(tiny_checkpoint):
    split = SplitModel.from_checkpoint(tiny_checkpoint, 1)
    ids = list(range(5, 25))
    got = split_logits(split, ids, [4] + [1] * 16)
    assert (got - full_logits(tiny_checkpoint, ids)).abs().max() <= TOLERANCE


def test_middle_batches_sessions_of_different_lengths(tiny_checkpoint):
    split = SplitModel.from_checkpoint(tiny_checkpoint, 2)
    rng = random.Random(11)
    prompts = [[rng.randrange(tiny_checkpoint.vocab_size) for _ in range(n)] for n in (3, 17, 9, 1)]
    device_caches = [split.input.new_cache() for _ in prompts]
    cloud_caches = [split.middle.new_cache() for _ in prompts]
    # Step 1: a prefix of each prompt, all sessions in one batched pass.
    cut = [max(1, len(p) // 2) for p in prompts]
    items = [
        (cc, split.input(torch.tensor(p[:c]), dc)) for p, c, dc, cc in zip(prompts, cut, device_caches, cloud_caches)
    ]
    split.middle.forward_batch(items)
    # Step 2: the rest (sessions with nothing left send one extra token), again batched.
    rests = [p[c:] or [7] for p, c in zip(prompts, cut)]
    items = [(cc, split.input(torch.tensor(r), dc)) for r, dc, cc in zip(rests, device_caches, cloud_caches)]
    outs = split.middle.forward_batch(items)
    for p, c, r, out in zip(prompts, cut, rests, outs):
        expected = full_logits(tiny_checkpoint, p[:c] + r)[c:]
        assert (split.output(out) - expected).abs().max() <= TOLERANCE


def test_pipeline_stages_compose_to_the_middle(tiny_checkpoint):
    ranges = stage_ranges(1, tiny_checkpoint.num_layers, 3)
    assert ranges[0][0] == 1 and ranges[-1][1] == tiny_checkpoint.num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    split = SplitModel.from_checkpoint(tiny_checkpoint, 1)
    stages = [MiddleSubmodel(tiny_checkpoint, 1, stage=r) for r in ranges]
    ids = list(range(3, 15))
    shallow = split.input(torch.tensor(ids), split.input.new_cache())
    whole = split.middle.forward_batch([(split.middle.new_cache(), shallow)])[0]
    hidden = shallow
    for stage in stages:
        hidden = stage.forward_batch([(stage.new_cache(), hidden)])[0]
    assert (hidden - whole).abs().max() <= TOLERANCE


def test_split_and_cache_errors(tiny_checkpoint, tmp_path):
    for bad in (0, tiny_checkpoint.num_layers, -1):
        with pytest.raises(SplitError):
            SplitModel.from_checkpoint(tiny_checkpoint, bad)
    cache = SplitModel.from_checkpoint(tiny_checkpoint, 1).input.new_cache()
    with pytest.raises(KVCacheError):
        cache.truncate(1)
    cache.free()
    with pytest.raises(KVCacheError):
        cache.truncate(0)
    with pytest.raises(ModelLoadError, match="not found"):
        load_checkpoint(tmp_path / "missing")
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ModelLoadError, match="not a Llama-family"):
        load_checkpoint(tmp_path / "bert")


def test_warm_ups_leave_no_state_behind(tiny_checkpoint):
    """Warm-up passes run every kernel once on throwaway sessions and free them."""
    from shared.model.adapter import DraftAdapter
    from shared.model.split import MiddleSubmodel, warm_up_layers
    from shared.specdec.device_session import DeviceModel, warm_up_device

    middle = MiddleSubmodel(tiny_checkpoint, 2)
    warm_up_layers(middle, tiny_checkpoint.hidden_size, sizes=(16, 1))
    device = DeviceModel.from_checkpoint(tiny_checkpoint, 2, DraftAdapter(tiny_checkpoint, 2))
    warm_up_device(device, prompt_tokens=16)
    # Nothing leaks into later sessions: generation after the warm-ups equals the unsplit model.
    import asyncio

    from shared.specdec.decode_loop import LocalCloud, generate
    from shared.specdec.device_session import DeviceSession
    from shared.specdec.reference import generate_full

    ids = [5, 9, 2, 7, 11, 3]
    session = DeviceSession(device, ids, max_new_tokens=8)
    got = asyncio.run(generate(session, LocalCloud(middle))).token_ids
    assert got == generate_full(tiny_checkpoint, ids, 8).token_ids
