"""Lossless at int8 and int4: every mode's greedy output equals the unsplit model at the same precision.

A quantized checkpoint quantizes its HF modules in place (shared/model/quantized.py), so the unsplit
reference (`generate_full`, HF's own forward) computes with the very weights the split halves,
the verifier's runner, the token model and the draft adapter's template use. bf16 is covered
in tests/services/verifier_cloud/test_placement.py; fp32 by every other mode test.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.device_agent.cloud_client import WebSocketCloud
from services.device_agent.token_mode import token_decode
from services.verifier_cloud.token_mode import TokenModel
from shared.model.adapter import DraftAdapter
from shared.model.checkpoint import load_checkpoint
from shared.model.split import MiddleSubmodel
from shared.runtime import build_device_model
from shared.specdec.decode_loop import LocalCloud, fixed_chunks, generate
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig
from shared.specdec.hat_async import hat_async_session
from shared.specdec.reference import generate_full
from shared.specdec.sampling import SamplingParams
from shared.specdec.stream_engine import StreamConfig, stream_config
from shared.specdec.stream_session import StreamSession
from shared.specdec.token_stream import token_stream_session
from tests.conftest import DEMO_MODEL_DIR
from tests.mesh_tools import split_identity, verifier_on_loopback

M = 2
PROMPTS = [[5, 17, 3, 99, 42, 8], [150, 2, 77, 31, 9, 64, 120, 33, 7, 11, 4]]
MAX_NEW = 20


@pytest.fixture(scope="module", params=["demo-int8", "qwen2-int8", "demo-int4"])
def quantized_checkpoint(request, tiny_qwen2_dir):
    model, kind = request.param.split("-")
    path = DEMO_MODEL_DIR if model == "demo" else tiny_qwen2_dir
    return load_checkpoint(path, quantize=kind, with_tokenizer=False)


@pytest.fixture(scope="module")
def expected(quantized_checkpoint):
    return [generate_full(quantized_checkpoint, p, MAX_NEW).token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def device(quantized_checkpoint):
    if quantized_checkpoint.path == DEMO_MODEL_DIR:  # its trained adapter: drafts get accepted, trees go deep
        return build_device_model(quantized_checkpoint, M, None)
    return DeviceModel.from_checkpoint(quantized_checkpoint, M, DraftAdapter(quantized_checkpoint, M).randomize(3))


@pytest.mark.parametrize(
    "config,options",
    [
        (DraftConfig(eta=0.0, max_draft=4), {}),
        (DraftConfig(eta=0.3, max_draft=6), {"parallel_candidates": 2, "parallel_steps": 3, "chunk_size": 3}),
        (DraftConfig(max_draft=4, tree_nodes=8, tree_width=2), {}),
        (DraftConfig(max_draft=0), {}),  # U-shape
    ],
    ids=["chain", "parallel-drafting", "tree", "ushape"],
)
def test_hat_rounds_equal_the_unsplit_model_at_the_same_quantization(
    quantized_checkpoint, device, expected, config, options
):
    accepted = 0
    for prompt, want in zip(PROMPTS, expected):
        session = DeviceSession(device, prompt, SamplingParams(), config, MAX_NEW)
        result = asyncio.run(generate(session, LocalCloud(MiddleSubmodel(quantized_checkpoint, M)), **options))
        assert result.token_ids == want
        accepted += sum(n - 1 for n in result.accept_lengths)
    if quantized_checkpoint.path == DEMO_MODEL_DIR and config.max_draft:
        assert accepted > 0  # drafts really were verified and kept


@pytest.mark.slow
def test_cloud_and_streamed_modes_equal_the_unsplit_model_at_the_same_quantization(
    quantized_checkpoint, device, expected
):
    async def main():
        token_model = TokenModel(quantized_checkpoint, M)
        async with verifier_on_loopback(quantized_checkpoint, M, token_model=token_model, full_model=True) as (_, url):
            cloud = WebSocketCloud(
                url, quantized_checkpoint.hidden_size, request_timeout_s=30, **split_identity(quantized_checkpoint, M)
            )
            got: dict[str, list[list[int]]] = {}
            for index, prompt in enumerate(PROMPTS):
                tokens = []
                async for emitted in token_decode(cloud, 10 + index, prompt, SamplingParams(), MAX_NEW, 0):
                    tokens += emitted
                got.setdefault("cloud", []).append(tokens)
                for offset, mode in enumerate(("token-sd", "picospec", "hat-async")):
                    session = StreamSession(device, prompt, SamplingParams(), DraftConfig(0.3, 6), MAX_NEW)
                    session_id = 100 * (offset + 1) + index
                    if mode == "hat-async":
                        config = stream_config(mode, group=2, window=8, max_draft=6)
                        rounds = hat_async_session(session, cloud, session_id, fixed_chunks(len(prompt), 4), config)
                    else:
                        config = (
                            StreamConfig(pipelined=False)
                            if mode == "token-sd"
                            else stream_config(mode, group=2, window=8, max_draft=6)
                        )
                        rounds = token_stream_session(session, cloud, session_id, config)
                    tokens = []
                    async for emitted in rounds:
                        tokens += emitted
                    got.setdefault(mode, []).append(tokens)
            await cloud.close_connection()
            return got

    for mode, outputs in asyncio.run(main()).items():
        assert outputs == expected, mode


def test_a_truncated_draft_vocabulary_reads_the_quantized_head_and_stays_lossless(quantized_checkpoint, expected):
    adapter = DraftAdapter(quantized_checkpoint, M).randomize(5)
    vocab = list(range(0, quantized_checkpoint.vocab_size, 3))
    adapter.set_draft_vocab(vocab)
    device = DeviceModel.from_checkpoint(quantized_checkpoint, M, adapter)
    hidden = torch.randn(3, quantized_checkpoint.hidden_size)
    drafted, full = device.draft_logits(hidden), device.output(hidden)
    torch.testing.assert_close(drafted[:, vocab], full[:, vocab], atol=1e-2, rtol=1e-2)
    assert torch.isinf(drafted[:, 1]).all()  # outside the draft vocabulary: never drafted
    session = DeviceSession(device, PROMPTS[0], SamplingParams(), DraftConfig(eta=0.0, max_draft=3), MAX_NEW)
    assert asyncio.run(generate(session, LocalCloud(MiddleSubmodel(quantized_checkpoint, M)))).token_ids == expected[0]
