"""The request fields current OpenAI clients and benchmark tools send (docs/api-compat.md).

Unit tests on the request models (services/token_streamer/openai_format.py), then the same
fields end to end through the real streamer app and the real `openai` client, in front of
test_token_streamer.py's device double (which records the body each request reached it with).
The device's side of ignore_eos and seed runs on a real mesh in tests/e2e/test_smollm2_chat.py.
"""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest
from pydantic import ValidationError

from services.token_streamer import openai_format as of
from tests.services.token_streamer.test_token_streamer import CHAT, FakeDevice, client, expected_text, mesh, raw_events


def chat(**fields) -> of.ChatRequest:
    return of.ChatRequest.model_validate({"messages": CHAT, **fields})


def refusal(model: type[of.SamplingRequest], body: dict) -> tuple[str, str | None]:
    """The (message, param) of the 400 a body gets."""
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return of.validation_error(caught.value.errors())


# -- the request models ------------------------------------------------------------------------------


def test_text_parts_are_joined_and_other_parts_are_a_clear_refusal() -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    req = of.ChatRequest.model_validate(
        {"messages": [{"role": "system", "content": [parts[0]]}, {"role": "user", "content": parts}]}
    )
    assert req.turns == [{"role": "system", "content": "first"}, {"role": "user", "content": "first\nsecond"}]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    message, param = refusal(of.ChatRequest, {"messages": [{"role": "user", "content": [parts[0], image]}]})
    assert message == (
        "messages.0.content: content part type 'image_url' is not supported: this model takes "
        "text only (parts of type 'text')"
    )
    assert param == "messages"
    message, _ = refusal(of.ChatRequest, {"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert "needs its 'text'" in message


def test_max_completion_tokens_wins_over_max_tokens_as_in_vllm() -> None:
    assert (chat().requested_tokens, chat().tokens_param) == (None, "max_tokens")
    assert (chat(max_tokens=9).requested_tokens, chat(max_tokens=9).tokens_param) == (9, "max_tokens")
    both = chat(max_tokens=9, max_completion_tokens=5)
    assert (both.requested_tokens, both.tokens_param) == (5, "max_completion_tokens")
    assert refusal(of.ChatRequest, {"messages": CHAT, "max_completion_tokens": 0})[1] == "max_completion_tokens"
    completion = of.CompletionRequest.model_validate({"prompt": "x", "max_tokens": 4})
    assert (completion.requested_tokens, completion.tokens_param) == (4, "max_tokens")


def test_n_is_one_or_a_clear_refusal() -> None:
    assert chat().n == chat(n=1).n == chat(n=None).n == 1
    message, param = refusal(of.ChatRequest, {"messages": CHAT, "n": 2})
    assert message == "n: n=2 is not supported: this server returns one choice per request (n must be 1)"
    assert param == "n"


def test_seed_stop_ignore_eos_and_stream_options() -> None:
    req = chat(
        seed=7, stop="END", ignore_eos=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
    )
    assert (req.seed, req.stop_list, req.ignore_eos, req.include_usage) == (7, ["END"], True, True)
    assert chat(stop=["a", "b"]).stop_list == ["a", "b"] and chat().stop_list == []
    assert not chat().ignore_eos and not chat().include_usage
    assert refusal(of.ChatRequest, {"messages": CHAT, "stop": ["a", ""]})[1] == "stop"


@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [
        ("hi", "hi", None),
        (["hi"], "hi", None),
        ([5, 0, 7], None, [5, 0, 7]),
        ([[5, 6]], None, [5, 6]),
    ],
)
def test_a_completion_prompt_in_each_of_openais_four_forms(prompt, text, ids) -> None:
    req = of.CompletionRequest.model_validate({"prompt": prompt})
    assert (req.prompt_text, req.prompt_ids) == (text, ids)


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]], [], [[]], [-1]])
def test_more_than_one_prompt_or_a_bad_token_id_is_refused(prompt) -> None:
    assert refusal(of.CompletionRequest, {"prompt": prompt})[1] == "prompt"


def test_unknown_fields_are_accepted_and_logged_once_per_set(caplog) -> None:
    of._WARNED_IGNORED.clear()
    body = {"messages": [{"role": "user", "content": "x", "name": "ann"}], "user": "u-1", "presence_penalty": 0.5}
    with caplog.at_level(logging.DEBUG, logger=of.log.name):
        first = of.ChatRequest.model_validate(body)
        of.ChatRequest.model_validate(body)
    assert first.turns == [{"role": "user", "content": "x"}]
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    request_line = (
        "the following fields of ChatRequest were present in the request but ignored: ['presence_penalty', 'user']"
    )
    assert (logging.WARNING, request_line) in lines and (logging.DEBUG, request_line) in lines
    assert any("ChatMessage" in m and "['name']" in m for _, m in lines)
    assert sum(level == logging.WARNING for level, _ in lines) == 2  # one per new set, not one per request


# -- through the app, with the real openai client ------------------------------------------------------


async def test_openai_client_fields_reach_the_device_as_asked() -> None:
    dev = FakeDevice("dev-a")
    parts = [{"type": "text", "text": "be brief"}, {"type": "text", "text": "hi"}]
    async with mesh(dev) as url, client(url) as oai:
        reply = await oai.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": parts}],
            max_tokens=9,
            max_completion_tokens=5,
            n=1,
            seed=11,
            stop=["zzz"],
            user="u-1",
            presence_penalty=0.0,
            extra_body={"ignore_eos": True, "top_k": 5, "repetition_penalty": 1.0},
        )
        assert reply.choices[0].message.content == expected_text(5) and reply.choices[0].finish_reason == "length"
        completion = await oai.completions.create(model="m", prompt=[3, 1, 4], max_tokens=3)
        assert completion.choices[0].text == expected_text(3)
    sent = dev.requests[0]
    assert sent["messages"] == [{"role": "user", "content": "be brief\nhi"}]
    assert (sent["max_new_tokens"], sent["seed"], sent["ignore_eos"]) == (5, 11, True)
    assert not {"user", "presence_penalty", "top_k", "repetition_penalty", "n", "stop"} & set(sent)
    assert dev.requests[1]["prompt_ids"] == [3, 1, 4] and "prompt" not in dev.requests[1]
    assert "ignore_eos" not in dev.requests[1]  # only sent when asked


async def test_streamed_usage_comes_last_with_no_choices() -> None:
    async with mesh(FakeDevice("dev-a")) as url:
        async with client(url) as oai:
            stream = await oai.chat.completions.create(
                model="m",
                messages=CHAT,
                max_completion_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
            )
            chunks = [c async for c in stream]
        events = await raw_events(
            url,
            "/v1/completions",
            {"prompt": [[7, 8]], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
        )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_text(4)
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].choices == [] and chunks[-2].choices[0].finish_reason == "length"
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens, chunks[-1].usage.total_tokens) == (
        5,
        4,
        9,
    )
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


async def test_refusals_are_openai_errors_naming_the_field() -> None:
    image = {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}
    async with mesh(FakeDevice("dev-a"), max_new_tokens_limit=100) as url:
        async with client(url) as oai:
            with pytest.raises(openai.BadRequestError, match="content part type 'image_url' is not supported"):
                await oai.chat.completions.create(model="m", messages=[{"role": "user", "content": [image]}])
            with pytest.raises(openai.BadRequestError, match="n=3 is not supported"):
                await oai.chat.completions.create(model="m", messages=CHAT, n=3)
        async with httpx.AsyncClient(timeout=10) as http:
            too_many = await http.post(
                f"{url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5, "max_completion_tokens": 101}
            )
            ids = await http.post(f"{url}/v1/completions", json={"prompt": [[1], [2]]})
    assert too_many.status_code == 400
    assert too_many.json()["error"] == {
        "message": "max_completion_tokens must be <= 100",
        "type": "invalid_request_error",
        "param": "max_completion_tokens",
        "code": "invalid_request",
    }
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "prompt"
