"""Uplink hardening (shared/privacy/uplink_hardening.py): through a re-parameterised cloud the secret rotation keeps
greedy output token-identical to the unsplit model while the cloud never sees the plain shallow states; uplink
noise has the asked scale and is off at sigma 0; the agent and the verifier wire both from their settings."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from shared.model.adapter import DraftAdapter
from shared.model.checkpoint import load_checkpoint
from shared.model.split import MiddleSubmodel
from shared.privacy.hidden_rotation import RotationError, rotate_layers, secret_rotation
from shared.privacy.uplink_hardening import NoisyUplink, RotatingCloud
from shared.specdec.decode_loop import LocalCloud, generate
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig
from shared.specdec.reference import generate_full
from shared.specdec.sampling import SamplingParams
from tests.conftest import DEMO_MODEL_DIR
from tests.mesh_tools import device_agent_http, verifier_on_loopback


class RecordingCloud:
    """Records the hidden rows each call hands on (what the verifier would receive)."""

    def __init__(self, inner):
        self.inner = inner
        self.sent: list[torch.Tensor] = []

    async def open(self, session_id):
        await self.inner.open(session_id)

    async def send_prefill(self, session_id, start_pos, shallow, is_last):
        self.sent.append(shallow.clone())
        return await self.inner.send_prefill(session_id, start_pos, shallow, is_last)

    async def verify(self, session_id, commit_len, shallow):
        self.sent.append(shallow.clone())
        return await self.inner.verify(session_id, commit_len, shallow)

    async def send_verify(self, session_id, commit_len, shallow):
        self.sent.append(shallow.clone())
        return await self.inner.send_verify(session_id, commit_len, shallow)

    async def close(self, session_id):
        await self.inner.close(session_id)


def rotated_middle(path, m: int, secret: str) -> MiddleSubmodel:
    middle = MiddleSubmodel(load_checkpoint(path, with_tokenizer=False), m)  # its own weights: rotated in place
    rotate_layers(middle, secret_rotation(secret, middle.layers[0].input_layernorm.weight.shape[0], torch.float64))
    return middle


def split_run(checkpoint, cloud, ids, m, max_new, max_draft=4, **options):
    device = DeviceModel.from_checkpoint(checkpoint, m, DraftAdapter(checkpoint, m))
    session = DeviceSession(device, ids, SamplingParams(), DraftConfig(eta=0.3, max_draft=max_draft), max_new)
    return asyncio.run(generate(session, cloud, **options)), session


@pytest.mark.parametrize(
    "model_type,m,chunk_size", [("llama", 2, None), ("llama", 1, 3), ("qwen2", 2, 4), ("qwen2", 3, None)]
)
@pytest.mark.slow
def test_greedy_through_the_rotated_split_equals_the_unsplit_model(
    model_type, m, chunk_size, tiny_llama_dir, tiny_qwen2_dir
):
    path = tiny_llama_dir if model_type == "llama" else tiny_qwen2_dir
    checkpoint = load_checkpoint(path, with_tokenizer=False)  # the device's (public) weights
    q = secret_rotation("tenant-a", checkpoint.hidden_size)
    for ids in ([5, 17, 3, 99, 42, 7], [11] * 13, [200]):
        expected = generate_full(checkpoint, ids, 20).token_ids
        recorder = RecordingCloud(LocalCloud(rotated_middle(path, m, "tenant-a")))
        result, _ = split_run(
            checkpoint,
            RotatingCloud(recorder, q),
            ids,
            m,
            20,
            chunk_size=chunk_size,
            parallel_candidates=2,
            parallel_steps=2,
        )
        assert result.token_ids == expected
        # Unrotated, the same re-parameterised cloud decodes something else: the rotation is really in use.
        if ids == [11] * 13:
            plain, _ = split_run(checkpoint, LocalCloud(rotated_middle(path, m, "tenant-a")), ids, m, 20)
            assert plain.token_ids != expected


def test_greedy_through_the_rotated_split_on_the_demo_model(demo_checkpoint):
    prompt = demo_checkpoint.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    expected = generate_full(demo_checkpoint, prompt, 32).token_ids
    q = secret_rotation("demo", demo_checkpoint.hidden_size)
    device = DeviceModel.from_checkpoint(demo_checkpoint, 2, DraftAdapter(demo_checkpoint, 2))
    session = DeviceSession(device, prompt, SamplingParams(), DraftConfig(eta=0.6, max_draft=6), 32)
    cloud = RotatingCloud(LocalCloud(rotated_middle(DEMO_MODEL_DIR, 2, "demo")), q)
    assert asyncio.run(generate(session, cloud, chunk_size=4)).token_ids == expected


def test_the_cloud_receives_rotated_states_not_the_shallow_ones(tiny_llama_dir):
    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    q = secret_rotation("tenant-b", checkpoint.hidden_size)
    inner = RecordingCloud(LocalCloud(rotated_middle(tiny_llama_dir, 2, "tenant-b")))
    outer = RecordingCloud(RotatingCloud(inner, q))  # `outer.sent`: the device's plain shallow rows
    split_run(checkpoint, outer, [4, 8, 15, 16, 23, 42], 2, 12, chunk_size=2)
    assert len(inner.sent) == len(outer.sent) > 3
    for plain, seen in zip(outer.sent, inner.sent):
        assert seen.shape == plain.shape
        assert not torch.allclose(seen, plain, atol=1e-2)
        assert torch.allclose(seen @ q, plain, atol=1e-5)  # rotating back gives it
        # the rotation keeps each row's norm (what RMSNorm reads): only the basis is hidden
        assert torch.allclose(seen.norm(dim=-1), plain.norm(dim=-1), rtol=1e-5)


def test_a_wrong_size_or_non_orthogonal_rotation_is_refused():
    with pytest.raises(RotationError):
        RotatingCloud(object(), torch.eye(64)[:, :32])
    with pytest.raises(RotationError):
        RotatingCloud(object(), torch.eye(64) * 1.5)


def test_uplink_noise_has_the_asked_scale_and_is_off_at_zero(tiny_llama_dir):
    shallow = torch.randn(400, 64, generator=torch.Generator().manual_seed(3)) * 5  # [S, H]
    rms = shallow.pow(2).mean(-1, keepdim=True).sqrt()
    noisy = NoisyUplink(object(), 0.1, torch.Generator().manual_seed(0)).noisy(shallow)
    relative = (noisy - shallow) / rms  # ~ N(0, 0.1^2) per element
    assert abs(relative.std().item() - 0.1) < 0.005 and abs(relative.mean().item()) < 0.005
    assert NoisyUplink(object(), 0.0).noisy(shallow) is shallow
    with pytest.raises(ValueError):
        NoisyUplink(object(), -0.1)

    # Through a split: sigma 0 is the plain split (token-identical), and the cloud gets exactly the rows sent.
    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    ids = [9, 8, 7, 6, 5]
    expected = generate_full(checkpoint, ids, 16).token_ids
    recorder = RecordingCloud(LocalCloud(MiddleSubmodel(checkpoint, 2)))
    assert split_run(checkpoint, NoisyUplink(recorder, 0.0), ids, 2, 16)[0].token_ids == expected
    plain = torch.cat(recorder.sent)
    noisy_recorder = RecordingCloud(LocalCloud(MiddleSubmodel(checkpoint, 2)))
    split_run(checkpoint, NoisyUplink(noisy_recorder, 0.5, torch.Generator().manual_seed(1)), ids, 2, 16)
    first = noisy_recorder.sent[0]  # the prompt's rows: the same positions as the plain run's first upload
    ratio = (first - plain[: len(first)]).pow(2).mean(-1).sqrt() / plain[: len(first)].pow(2).mean(-1).sqrt()
    assert torch.all((ratio > 0.25) & (ratio < 0.8))  # per-row relative noise ~ 0.5 (64 dims)


def test_passthrough_of_what_carries_no_hidden_states():
    class Inner:
        ready = True

        def rows(self, session_id, length):
            return ["row"] * length

    wrapped = NoisyUplink(RotatingCloud(Inner(), torch.eye(8)), 0.5)
    assert wrapped.ready is True and wrapped.rows(1, 2) == ["row", "row"]


async def _generate_via_agent(model_dir, url, prompt_ids, **device_overrides):
    async with device_agent_http(model_dir, url, 2, speculative=True, max_draft=4, **device_overrides) as http:
        lines = []
        async with http.stream("POST", "/generate", json={"prompt_ids": prompt_ids, "max_new_tokens": 16}) as resp:
            async for line in resp.aiter_lines():
                if line:
                    lines.append(json.loads(line))
    tokens = [t for e in lines if e["type"] == "tokens" for t in e["token_ids"]]
    return tokens, lines[-1]


@pytest.mark.parametrize("mode", ["hat", "hat-async"])
def test_device_agent_and_loopback_verifier_with_the_same_secret(tiny_llama_dir, mode):
    """Real WebSockets: the verifier re-parameterises its middle layers from its setting, the agent rotates its
    uplink from its own; greedy equals the unsplit model. A device with another secret is refused at open."""
    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = generate_full(checkpoint, ids, 16).token_ids

    async def main():
        async with verifier_on_loopback(checkpoint, 2, hidden_rotation="mesh-secret") as (_server, url):
            same = await _generate_via_agent(tiny_llama_dir, url, ids, hidden_rotation="mesh-secret", mode=mode)
            other = await _generate_via_agent(tiny_llama_dir, url, ids, hidden_rotation="other", mode=mode)
        return same, other

    (tokens, done), (other_tokens, other_done) = asyncio.run(main())
    assert done["type"] == "done" and tokens == expected
    assert other_done["type"] == "error" and "fingerprint" in other_done["message"]
    # the fixture's checkpoint is public: the verifier rotated a copy
    assert generate_full(checkpoint, ids, 16).token_ids == expected


def test_each_pipeline_stage_is_rotated_from_its_spec(tiny_qwen2_dir):
    """P > 1: every stage worker re-parameterises its own sub-range; chained, they compute the rotated middle."""
    from services.verifier_cloud.settings import Settings
    from services.verifier_cloud.stage_specs import plan_stages
    from services.verifier_cloud.stages import build_worker

    settings = Settings(
        model_dir=str(tiny_qwen2_dir), split_layers=2, pipeline_stages=2, device="cpu", hidden_rotation="staged"
    )
    specs = plan_stages(settings, 5)
    assert [s.layers for s in specs] == [(2, 4), (4, 5)] and all(s.hidden_rotation == "staged" for s in specs)
    assert "staged" not in repr(specs[0]) and "staged" not in repr(settings)
    stages = [build_worker(spec).runner.layers for spec in specs]
    original = MiddleSubmodel(load_checkpoint(tiny_qwen2_dir, with_tokenizer=False), 2)
    q = secret_rotation("staged", 64)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))  # [S, H]
    expected = original.forward_batch([(original.new_cache(), x)])[0]
    hidden = x @ q.T
    for stage in stages:
        hidden = stage.forward_batch([(stage.new_cache(), hidden)])[0]
    assert torch.allclose(hidden @ q, expected, atol=1e-4, rtol=1e-4)


def test_settings_refuse_what_cannot_hold():
    from services.device_agent.settings import Settings as DeviceSettings
    from services.verifier_cloud.settings import Settings as VerifierSettings

    with pytest.raises(ValueError, match="full_model"):
        VerifierSettings(full_model=True, hidden_rotation="s").validate()
    with pytest.raises(ValueError, match="uplink_noise"):
        DeviceSettings(uplink_noise=-0.5).validate()
    assert "topsecret" not in repr(DeviceSettings(hidden_rotation="topsecret"))


def test_device_agent_with_uplink_noise_still_serves(tiny_llama_dir):
    """Noise is wired in (hat: outside the replaying cloud): the request completes; its tokens are the noisy split
    model's, so they are not compared with the unsplit model's."""
    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)

    async def main():
        async with verifier_on_loopback(checkpoint, 2) as (_server, url):
            return await _generate_via_agent(tiny_llama_dir, url, [7, 7, 3, 2], uplink_noise=0.05)

    tokens, done = asyncio.run(main())
    assert done["type"] == "done" and len(tokens) == 16
