"""The draft adapter's variants (shared/model/adapter.py) and how the device session feeds them:
any variant, trained or random, leaves greedy output equal to the unsplit model; the feature
variant's cache ends up computed from the cloud's exact deep states; files round-trip."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from shared.model.adapter import AdapterError, AdapterSpec, DraftAdapter
from shared.model.split import MiddleSubmodel
from shared.specdec.decode_loop import LocalCloud, generate
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig
from shared.specdec.reference import generate_full
from shared.specdec.sampling import SamplingParams

SPECS = [AdapterSpec("hat"), AdapterSpec("fusion"), AdapterSpec("feature"), AdapterSpec("feature", mlp=True)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("randomized", [False, True])
@pytest.mark.slow
def test_every_variant_is_lossless_greedy(tiny_checkpoint, spec, randomized):
    m = 2
    adapter = DraftAdapter(tiny_checkpoint, m, spec)
    if randomized:
        adapter.randomize(seed=5)
    device = DeviceModel.from_checkpoint(tiny_checkpoint, m, adapter)
    cloud = LocalCloud(MiddleSubmodel(tiny_checkpoint, m))
    rng = random.Random(len(spec.name))
    for candidates in (0, 3):
        ids = [rng.randrange(1, tiny_checkpoint.vocab_size) for _ in range(rng.randint(2, 14))]
        session = DeviceSession(device, ids, SamplingParams(), DraftConfig(eta=0.0, max_draft=4), 28)
        result = asyncio.run(generate(session, cloud, chunk_size=3, parallel_candidates=candidates, parallel_steps=2))
        assert result.token_ids == generate_full(tiny_checkpoint, ids, 28).token_ids


def _deep_and_shallow(checkpoint, ids: list[int], m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsplit model's state after layer m and its final state before the norm, per position."""
    captured = {}
    hook = checkpoint.model.model.norm.register_forward_hook(lambda _m, inputs, _o: captured.update(deep=inputs[0]))
    try:
        with torch.no_grad():
            out = checkpoint.model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    return out.hidden_states[m][0], captured["deep"][0]  # each [S, H]


def test_feature_adapter_cache_holds_the_exact_deep_states_after_each_round(tiny_checkpoint):
    """After verification the adapter's rows for accepted drafts are recomputed from the cloud's deep
    states: its cache equals one pass over the committed positions with zeros inside the prompt and
    the exact previous deep state everywhere after it."""
    m = 2
    adapter = DraftAdapter(tiny_checkpoint, m, AdapterSpec("feature"))
    with torch.no_grad():  # mix the previous deep state in, so a stale row would differ
        adapter.fuse.weight[:, tiny_checkpoint.hidden_size :] += 0.5 * torch.eye(tiny_checkpoint.hidden_size)
    device = DeviceModel.from_checkpoint(tiny_checkpoint, m, adapter)
    device.eos_token_id = None
    middle = MiddleSubmodel(tiny_checkpoint, m)
    prompt = [5, 9, 2, 7, 3]
    session = DeviceSession(device, prompt, SamplingParams(), DraftConfig(eta=0.0, max_draft=3), 40)
    cloud_cache = middle.new_cache()
    _, shallow = session.prefill_chunk(len(prompt))
    session.on_prefill_result(middle.forward_batch([(cloud_cache, shallow)])[0][-1:])
    accepted = 0
    while not session.is_finished:
        draft = session.draft()
        cloud_cache.truncate(draft.commit_len)
        deep = middle.forward_batch([(cloud_cache, draft.shallow)])[0]
        accepted += len(session.on_verify_result(draft, deep)) - 1
    assert accepted > 0  # some drafts were accepted, so some rows were recomputed
    committed = prompt + session.generated[:-1]  # the pending token is in no cache yet
    assert session.commit_len == len(committed)
    shallow_all, deep_all = _deep_and_shallow(tiny_checkpoint, committed, m)
    prev = torch.cat([torch.zeros(len(prompt), deep_all.shape[1]), deep_all[len(prompt) - 1 : -1]])
    reference = adapter.new_cache()
    adapter(shallow_all, reference, prev)
    got, want = session.adapter_cache.layer(0), reference.layer(0)
    assert got.length == want.length
    torch.testing.assert_close(got.keys[:, : got.length], want.keys[:, : want.length], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_adapter_file_round_trips_its_variant(tiny_checkpoint, tmp_path, spec):
    adapter = DraftAdapter(tiny_checkpoint, 2, spec).randomize(seed=3)
    path = tmp_path / "a.safetensors"
    adapter.save(path, {"note": "test"})
    loaded = DraftAdapter.load(path, tiny_checkpoint, 2)
    assert loaded.spec == spec
    for name, tensor in adapter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)


def test_bad_adapter_inputs_are_typed_errors(tiny_checkpoint, tmp_path):
    with pytest.raises(AdapterError, match="variant"):
        AdapterSpec("eagle3")
    adapter = DraftAdapter(tiny_checkpoint, 2, AdapterSpec("feature"))
    shallow = torch.zeros(3, tiny_checkpoint.hidden_size)
    with pytest.raises(AdapterError, match="side input"):
        adapter(shallow, adapter.new_cache(), None)
    not_safetensors = tmp_path / "junk.safetensors"
    not_safetensors.write_bytes(b"\x00" * 64)
    with pytest.raises(AdapterError):
        DraftAdapter.load(not_safetensors, tiny_checkpoint, 2)
    adapter.save(tmp_path / "m2.safetensors")
    with pytest.raises(AdapterError, match="split-layers 2"):
        DraftAdapter.load(tmp_path / "m2.safetensors", tiny_checkpoint, 3)
