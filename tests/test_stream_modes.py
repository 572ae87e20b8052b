"""token-sd, picospec and hat-async end to end: the demo model and its draft adapter on the device, the real
VerifierServer (with the whole model for token mode) on a loopback WebSocket, the device agent's real client,
and an emulated round trip on the link (the client's in-process delay line).

Greedy output must be token-identical to the unsplit model in every mode at every round trip; sampled
output is checked for distribution in tests/test_draft_stream.py (the accept rule) — here, that a seeded
sampled stream runs to the end in every mode with sane verdicts.
"""

from __future__ import annotations

import asyncio

import pytest

from services.device_agent.cloud_client import WebSocketCloud
from services.verifier_cloud.token_mode import TokenModel
from shared.links import LinkProfile
from shared.runtime import build_device_model
from shared.specdec.device_session import DraftConfig
from shared.specdec.engine import fixed_chunks
from shared.specdec.reference import generate_full
from shared.specdec.sampling import SamplingParams
from shared.specdec.stream_engine import StreamConfig, StreamTimings, hat_async_session, token_stream_session
from shared.specdec.stream_session import StreamSession
from tests.mesh_tools import split_identity, verifier_on_loopback

M = 2
PROMPTS = [[1, 15, 27, 99, 4, 8, 16], [3, 300, 301, 5, 7, 9, 11, 2, 44, 45, 46]]


@pytest.fixture(scope="module")
def device_model(demo_checkpoint):
    return build_device_model(demo_checkpoint, M, None)


def link(rtt_ms: float) -> LinkProfile | None:
    return LinkProfile(float("inf"), float("inf"), rtt_ms / 2e3) if rtt_ms else None


async def decode(mode: str, cloud: WebSocketCloud, session: StreamSession, session_id: int, config: StreamConfig,
                 downlink: str = "topk", timings: StreamTimings | None = None) -> list[int]:
    tokens: list[int] = []
    if mode == "hat-async":
        rounds = hat_async_session(session, cloud, session_id, fixed_chunks(len(session.prompt_ids), 4), config,
                                   timings=timings)
    else:
        rounds = token_stream_session(session, cloud, session_id, config, downlink=downlink, timings=timings)
    async for emitted in rounds:
        assert emitted, "a delivery holds at least one token"
        tokens += emitted
    return tokens


def configs(mode: str) -> list[StreamConfig]:
    if mode == "token-sd":
        return [StreamConfig(pipelined=False)]
    return [StreamConfig(pipelined=True, group=1, window=3), StreamConfig(pipelined=True, group=2, window=8)]


@pytest.mark.parametrize("rtt_ms", [0, 20, 60])
@pytest.mark.parametrize("mode", ["token-sd", "picospec", "hat-async"])
def test_greedy_output_equals_the_unsplit_model(demo_checkpoint, device_model, mode, rtt_ms):
    max_new = 24
    expected = [generate_full(demo_checkpoint, p, max_new).token_ids for p in PROMPTS]

    async def main():
        async with verifier_on_loopback(demo_checkpoint, M, token_model=TokenModel(demo_checkpoint, M),
                                        full_model=True) as (server, url):
            cloud = WebSocketCloud(url, demo_checkpoint.hidden_size, link=link(rtt_ms), request_timeout_s=30,
                                   **split_identity(demo_checkpoint, M))
            stats = []
            for c, config in enumerate(configs(mode)):
                for i, prompt in enumerate(PROMPTS):
                    session = StreamSession(device_model, prompt, SamplingParams(), DraftConfig(0.3, 6), max_new)
                    timings = StreamTimings()
                    got = await decode(mode, cloud, session, 100 * c + i + 1, config, timings=timings)
                    assert got == expected[i], (config, i)
                    assert session.generated == got
                    stats.append((timings, session))
            await cloud.close_connection()
            await asyncio.sleep(0.05)
            assert not server.scheduler.sessions  # every session closed, its KV freed
            return stats

    stats = asyncio.run(main())
    verdicts = [v for _, s in stats for v in s.verdicts]
    assert any(accepted > 0 for _, accepted in verdicts), "the draft adapter never got a token accepted"
    if mode != "token-sd" and rtt_ms:
        # the pipeline really ran ahead: some chunks were drafted on a token rejected meanwhile
        assert sum(t.stale_chunks for t, _ in stats) > 0


# hat-async verifies on the device, which has the whole target row: it has no downlink to choose
@pytest.mark.parametrize("mode, downlink", [("token-sd", "topk"), ("token-sd", "full"), ("picospec", "topk"),
                                            ("picospec", "full"), ("hat-async", "full")])
def test_seeded_sampled_streams_finish_with_consistent_verdicts(demo_checkpoint, device_model, mode, downlink):
    async def main():
        async with verifier_on_loopback(demo_checkpoint, M, token_model=TokenModel(demo_checkpoint, M),
                                        full_model=True) as (server, url):
            cloud = WebSocketCloud(url, demo_checkpoint.hidden_size, link=link(20), request_timeout_s=30,
                                   **split_identity(demo_checkpoint, M))
            out = []
            for seed in range(3):
                session = StreamSession(device_model, PROMPTS[0], SamplingParams(0.8, 1.0, seed), DraftConfig(0.3, 6),
                                        20)
                out.append((await decode(mode, cloud, session, seed + 1, configs(mode)[-1], downlink), session))
            await cloud.close_connection()
            return out

    for tokens, session in asyncio.run(main()):
        assert len(tokens) == 20 or tokens[-1] == device_model.eos_token_id
        assert all(0 <= t < device_model.vocab_size for t in tokens)
        assert sum(session.accept_lengths) + 1 == len(tokens)
        assert all(0 <= accepted <= drafted for drafted, accepted in session.verdicts)
