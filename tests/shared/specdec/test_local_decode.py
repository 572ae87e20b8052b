"""The `device` endpoint: the draft model alone (shared/specdec/local_decode.py), and the device
agent serving it and continuing another endpoint's answer from `prefix_ids` (DiSCo's migration)."""

from __future__ import annotations

import json

import pytest

from services.device_agent.detokenizer import IncrementalDetokenizer
from services.verifier_cloud.token_mode import TokenModel
from shared.model.checkpoint import load_checkpoint
from shared.runtime import build_device_model
from shared.specdec.device_session import DraftConfig, SessionError
from shared.specdec.local_decode import LocalSession, local_session
from shared.specdec.reference import generate_full
from shared.specdec.sampling import SamplingParams
from tests.mesh_tools import device_agent_http, verifier_on_loopback

M = 2
PROMPT = [9, 8, 7, 6, 5, 4, 3]


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir, with_tokenizer=False)


@pytest.fixture(scope="module")
def device_model(checkpoint):
    return build_device_model(checkpoint, M, "random")


async def _inline(fn, *args):
    return fn(*args)


async def generate_alone(model, prompt, max_new, params=SamplingParams()):
    session = LocalSession(model, list(prompt), params, DraftConfig(0.6, 0), max_new)
    return [t async for tokens in local_session(session, _inline) for t in tokens]


async def test_greedy_steps_equal_a_fresh_prefill_of_everything_before(device_model):
    # HAT's adapter reads no side input, so the cached step-by-step decode must equal
    # re-reading the whole sequence as a prompt at every position.
    assert device_model.adapter.spec.side_input is None
    tokens = await generate_alone(device_model, PROMPT, 12)
    assert len(tokens) == 12
    for k in range(len(tokens)):
        fresh = LocalSession(device_model, PROMPT + tokens[:k], SamplingParams(), DraftConfig(0.6, 0), 1)
        assert fresh.prefill() == [tokens[k]]


async def test_seeded_sampling_repeats_and_seeds_differ(device_model):
    a = await generate_alone(device_model, PROMPT, 16, SamplingParams(1.0, 1.0, 7))
    b = await generate_alone(device_model, PROMPT, 16, SamplingParams(1.0, 1.0, 7))
    c = await generate_alone(device_model, PROMPT, 16, SamplingParams(1.0, 1.0, 8))
    assert a == b and a != c


def test_needs_a_draft_adapter(checkpoint):
    plain = build_device_model(checkpoint, M, None, speculative=False)
    with pytest.raises(SessionError, match="draft adapter"):
        LocalSession(plain, PROMPT, SamplingParams(), DraftConfig(0.6, 0), 4).prefill()


class _CharTokenizer:
    """One character per token id (enough to see how deltas join)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_detokenizer_continues_the_text_of_a_prefix():
    whole = IncrementalDetokenizer(_CharTokenizer())
    text = whole.push([0, 1, 2]) + whole.push([3, 4])
    resumed = IncrementalDetokenizer(_CharTokenizer(), prefix_ids=[0, 1, 2])
    assert resumed.push([3, 4]) == text[3:] == "de"


class _HeldBackTokenizer(_CharTokenizer):
    """Token 9 starts a character that token 10 completes (a split multi-byte character)."""

    def decode(self, ids, skip_special_tokens=True):
        text = super().decode([i for i in ids if i not in (9, 10)])
        if 9 in ids:
            text += "\u00e9" if 10 in ids else "\ufffd"
        return text


def test_detokenizer_resumes_a_character_the_other_endpoint_held_back():
    source = IncrementalDetokenizer(_HeldBackTokenizer())
    shown = source.push([0, 1]) + source.push([9])  # "ab", then nothing: the character is incomplete
    assert shown == "ab"
    resumed = IncrementalDetokenizer(_HeldBackTokenizer(), prefix_ids=[0, 1, 9], prefix_text=shown)
    assert resumed.push([10]) == "\u00e9"  # the whole character, not just what followed the replacement


async def test_device_agent_device_mode_and_continuations(tiny_llama_dir, checkpoint, device_model):
    alone = await generate_alone(device_model, PROMPT, 10)
    prefix = alone[:4]
    token_model = TokenModel(checkpoint, M)
    async with verifier_on_loopback(checkpoint, M, token_model=token_model, full_model=True) as (server, url):
        async with device_agent_http(tiny_llama_dir, url, M) as http:

            async def run(**body):
                response = await http.post("/generate", json={"prompt_ids": PROMPT, **body})
                assert response.status_code == 200, response.text
                return [json.loads(line) for line in response.text.splitlines()]

            device = await run(mode="device", max_new_tokens=10)
            # the device picks up the device's own answer after 4 tokens: the same tokens follow
            resumed = await run(mode="device", max_new_tokens=6, prefix_ids=prefix)
            # the cloud picks up the device's first 4 tokens: the full model's continuation of them
            to_cloud = await run(mode="cloud", max_new_tokens=6, prefix_ids=prefix)
            bad = await http.post("/generate", json={"prompt_ids": PROMPT, "mode": "device", "prefix_ids": [10**9]})
            assert bad.status_code == 400 and "vocabulary" in bad.text
        assert not server.scheduler.sessions  # nothing left open in the cloud

    def tokens(events):
        return [t for e in events if e["type"] == "tokens" for t in e["token_ids"]]

    assert tokens(device) == alone
    assert device[0]["prompt_tokens"] == len(PROMPT)
    assert device[-1]["stats"]["mode"] == "device" and device[-1]["stats"]["privacy"] is True
    assert resumed[0]["prompt_tokens"] == len(PROMPT) + 4  # the prefix is read, not delivered again
    assert tokens(resumed) == alone[4:]
    expected = generate_full(checkpoint, PROMPT + prefix, 6).token_ids
    assert tokens(to_cloud) == expected
