"""A device whose split point or checkpoint is not the verifier's is refused at open (SPLIT_MISMATCH).

Before, a device at m=2 against a verifier at m=3 opened a session and got deep states of
the wrong layers: wrong tokens, silently.
"""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from services.device_agent.cloud_client import CloudError, WebSocketCloud
from shared.model.checkpoint import ModelLoadError, load_checkpoint, split_fingerprint
from shared.wire import schema as wire
from tests.mesh_tools import verifier_on_loopback


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir, with_tokenizer=False)


def _copy_with(tmp_path, source, name: str, change=None, shards: bool = False):
    """A copy of checkpoint dir `source` (same config.json); `change(tensors)` edits its weights first."""
    target = tmp_path / name
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    tensors = load_file(source / "model.safetensors")
    if change is not None:
        change(tensors)
    if not shards:
        save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
        return target
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, target / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return target


def _nudge(name: str):
    def change(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] += 1e-3

    return change


def test_fingerprint_covers_the_split_config_and_boundary_weights(tiny_llama_dir, tmp_path):
    base = {m: split_fingerprint(tiny_llama_dir, m) for m in (1, 2, 3)}
    assert len(set(base.values())) == 3 and all(0 <= f < 2**64 for f in base.values())
    assert split_fingerprint(tiny_llama_dir, 2) == base[2]  # stable
    # Same tensors stored as two shards with an index: the same checkpoint, the same number.
    assert split_fingerprint(_copy_with(tmp_path, tiny_llama_dir, "sharded", shards=True), 2) == base[2]
    # A boundary weight (layer m-1 or m) changes it; a layer away from the boundary does not.
    for name, layer in [("model.layers.1.mlp.down_proj.weight", 1), ("model.layers.2.input_layernorm.weight", 2)]:
        assert split_fingerprint(_copy_with(tmp_path, tiny_llama_dir, f"edit{layer}", _nudge(name)), 2) != base[2]
    far = _copy_with(tmp_path, tiny_llama_dir, "far", _nudge("model.layers.4.mlp.up_proj.weight"))
    assert split_fingerprint(far, 2) == base[2]
    # The config counts too, except where it records who saved the files.
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    (far / "config.json").write_text(json.dumps({**config, "transformers_version": "0.0.1"}))
    assert split_fingerprint(far, 2) == base[2]
    (far / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert split_fingerprint(far, 2) != base[2]
    with pytest.raises(ModelLoadError):
        split_fingerprint(tiny_llama_dir, 99)


def _device(url: str, checkpoint, checkpoint_dir, m: int) -> WebSocketCloud:
    return WebSocketCloud(
        url,
        checkpoint.hidden_size,
        wire.WireDtype.F32,
        split_layers=m,
        fingerprint=split_fingerprint(checkpoint_dir, m),
    )


async def test_device_at_m2_against_verifier_at_m3_is_refused_at_open(checkpoint, tiny_llama_dir):
    async with verifier_on_loopback(checkpoint, 3) as (server, url):
        cloud = _device(url, checkpoint, tiny_llama_dir, 2)
        with pytest.raises(CloudError) as info:
            await cloud.open(1)
        assert info.value.code == wire.ErrorCode.SPLIT_MISMATCH
        assert "layer 2" in str(info.value) and "layer 3" in str(info.value)
        assert not server.scheduler.sessions
        await cloud.close_connection()


async def test_another_checkpoint_with_the_same_config_is_refused(checkpoint, tiny_llama_dir, tmp_path):
    other = _copy_with(tmp_path, tiny_llama_dir, "other", _nudge("model.layers.2.self_attn.q_proj.weight"))
    async with verifier_on_loopback(checkpoint, 2) as (server, url):
        cloud = _device(url, checkpoint, other, 2)
        with pytest.raises(CloudError) as info:
            await cloud.open(1)
        assert info.value.code == wire.ErrorCode.SPLIT_MISMATCH and "fingerprint" in str(info.value)
        assert not server.scheduler.sessions
        # The same checkpoint and split on the same connection opens.
        same = _device(url, checkpoint, tiny_llama_dir, 2)
        await same.open(2)
        assert 2 in server.scheduler.sessions
        await same.close(2)
        await same.close_connection()
        await cloud.close_connection()


async def test_a_device_without_split_identity_cannot_open_a_hidden_state_session(checkpoint):
    async with verifier_on_loopback(checkpoint, 2) as (_, url):
        cloud = WebSocketCloud(url, checkpoint.hidden_size)
        with pytest.raises(ValueError, match="split_layers"):
            await cloud.open(1)
        await cloud.close_connection()
