"""SmolLM2-135M-Instruct served by the real mesh (one mesh of real processes for the module):
chat answers are the unsplit dequantized model's, token for token, on the prompt its own chat
template makes; multi-turn history goes through the template; generation stops at the
template's end-of-turn token (`<|im_end|>`), which never shows in the text. Plus unit tests of
the one chat renderer (template vs no-template tokenizer).

The mesh drafts with the committed SmolLM2 adapter (models/smollm2/draft_adapter.safetensors), so
drafted tokens are accepted and rejected along the way and the answers must still be the unsplit
model's."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from services.device_agent.__main__ import missing_adapter
from services.device_agent.settings import Settings as DeviceSettings
from shared.chat import ChatTemplateError, chat_prompt_ids, plain_chat_text
from shared.runtime import encode_prompt
from shared.specdec.device_session import SessionError
from shared.specdec.reference import generate_full
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig, MeshStartError
from tophatctl.mesh_ports import find_port_base

# end-to-end: real processes, meshes or long statistical runs (make test-fast leaves these out)
pytestmark = pytest.mark.slow

MAX_TOKENS = 24
END_OF_TURN = "<|im_end|>"


@pytest.fixture(scope="module")
def mesh():
    config = MeshConfig(model_dir="smollm2", num_devices=1, port_base=find_port_base(1))
    with Mesh(config) as running:
        yield running


def reference(checkpoint, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(templated prompt ids, the unsplit model's greedy answer ids) for a conversation."""
    ids = checkpoint.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return ids, generate_full(checkpoint, ids, MAX_TOKENS).token_ids


def openai_client(mesh: Mesh):
    from openai import OpenAI

    return OpenAI(base_url=f"{mesh.config.streamer_url}/v1", api_key="unused", timeout=120, max_retries=0)


# -- the renderer (no mesh) -------------------------------------------------------------------------


def test_template_tokenizer_renders_exactly_apply_chat_template(smollm2):
    tokenizer = smollm2.tokenizer
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    ids = chat_prompt_ids(tokenizer, history)
    assert ids == tokenizer.apply_chat_template(history, add_generation_prompt=True, return_dict=False)
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and text.count(END_OF_TURN) == 4
    assert "system: " not in text  # not the plain fallback
    # OpenAI's "developer" is the system role to a template
    developer = [{"role": "developer", "content": "Be brief."}, *history[1:]]
    assert chat_prompt_ids(tokenizer, developer) == ids
    assert encode_prompt(smollm2, None, None, history) == ids  # what the device agent calls


def test_end_of_turn_is_the_models_eos_and_is_hidden_from_text(smollm2):
    tokenizer = smollm2.tokenizer
    assert tokenizer.convert_tokens_to_ids(END_OF_TURN) == smollm2.eos_token_id == 2
    assert tokenizer.decode([504, smollm2.eos_token_id], skip_special_tokens=True) == tokenizer.decode([504])


def test_tokenizer_without_template_gets_role_lines(demo_checkpoint):
    tokenizer = demo_checkpoint.tokenizer
    assert not tokenizer.chat_template
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert plain_chat_text(messages) == "system: be brief\nuser: hi\nassistant:"
    assert chat_prompt_ids(tokenizer, messages) == tokenizer.encode(
        "system: be brief\nuser: hi\nassistant:", add_special_tokens=False
    )


def test_malformed_conversations_are_clear_errors(smollm2):
    for bad in ([], [{"role": "user"}], [{"role": "", "content": "x"}], [{"role": "user", "content": 3}]):
        with pytest.raises(ChatTemplateError):
            chat_prompt_ids(smollm2.tokenizer, bad)
    with pytest.raises(SessionError, match="exactly one"):
        encode_prompt(smollm2, "text", None, [{"role": "user", "content": "x"}])


def test_a_missing_adapter_is_a_clear_choice_before_anything_starts(tmp_path):
    with pytest.raises(MeshStartError, match="not a checkpoint directory"):
        Mesh(MeshConfig(model_dir=str(tmp_path / "nowhere"), log_dir=tmp_path / "logs")).start()
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(MeshStartError, match="--adapter random"):
        Mesh(MeshConfig(model_dir=str(tmp_path), log_dir=tmp_path / "logs")).start()
    # a device agent started on its own says the same in one line, before loading the model
    settings = DeviceSettings(model_dir=str(tmp_path))
    assert "TOPHAT_DEVICE_ADAPTER=random" in missing_adapter(settings)
    assert missing_adapter(dataclasses.replace(settings, adapter="random")) is None
    assert missing_adapter(dataclasses.replace(settings, speculative=False)) is None


# -- through the real mesh -------------------------------------------------------------------------


def test_greedy_chat_answer_is_the_unsplit_models(mesh, smollm2):
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Give me three tips for writing clear Python functions."},
    ]
    prompt_ids, expected = reference(smollm2, messages)
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = httpx.post(f"{mesh.config.streamer_url}/v1/chat/completions", json=body, timeout=120).json()
    assert reply["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(expected),
        "total_tokens": len(prompt_ids) + len(expected),
    }
    assert reply["choices"][0]["message"]["content"] == smollm2.tokenizer.decode(expected, skip_special_tokens=True)


def test_device_agent_renders_the_template_and_streams_the_unsplit_models_ids(mesh, smollm2):
    """The device agent itself, as the streamer calls it: ids from `messages` equal ids from prompt_ids."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt_ids, expected = reference(smollm2, messages)
    events = []
    with httpx.stream(
        "POST",
        f"{mesh.config.device_url(0)}/generate",
        auth=mesh.operator_auth(),
        json={"messages": messages, "max_new_tokens": MAX_TOKENS},
        timeout=120,
    ) as response:
        events = [json.loads(line) for line in response.iter_lines() if line]
    assert events[0] == {"type": "start", "request_id": events[0]["request_id"], "prompt_tokens": len(prompt_ids)}
    assert [t for e in events if e["type"] == "tokens" for t in e["token_ids"]] == expected
    assert expected[-1] == smollm2.eos_token_id  # the answer ends its turn within the budget
    assert events[-1]["finish_reason"] == "stop"
    assert END_OF_TURN not in "".join(e["text"] for e in events if e["type"] == "tokens")


def test_rounds_that_accept_drafts_still_give_the_unsplit_models_ids(mesh, smollm2):
    messages = [{"role": "user", "content": "Give me three tips for writing clear Python functions."}]
    _, expected = reference(smollm2, messages)
    with httpx.stream(
        "POST",
        f"{mesh.config.device_url(0)}/generate",
        auth=mesh.operator_auth(),
        # chain rounds named: the draft budget may choose rounds without drafts on a verifier this busy
        json={"messages": messages, "max_new_tokens": MAX_TOKENS, "draft_shape": "chain"},
        timeout=120,
    ) as response:
        rounds = [
            json.loads(line)["token_ids"]
            for line in response.iter_lines()
            if line and json.loads(line)["type"] == "tokens"
        ]
    assert [t for r in rounds for t in r] == expected
    assert max(len(r) for r in rounds) > 1  # the adapter's drafts were accepted in some round


def test_two_turn_chat_through_the_openai_client(mesh, smollm2):
    """The second question only makes sense with the first turn: the history goes through the template,
    each answer stops at <|im_end|> (finish_reason 'stop'), which never appears in the text."""
    client = openai_client(mesh)
    history = [{"role": "user", "content": "What is the capital of France?"}]
    answers = []
    for follow_up in (None, "What is its population?"):
        if follow_up is not None:
            history += [{"role": "assistant", "content": answers[-1]}, {"role": "user", "content": follow_up}]
        prompt_ids, expected = reference(smollm2, history)
        stream = client.chat.completions.create(
            model="smollm2",
            messages=history,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["stop"] and expected[-1] == smollm2.eos_token_id
        assert END_OF_TURN not in text
        assert text == smollm2.tokenizer.decode(expected, skip_special_tokens=True)
        assert chunks[-1].usage.prompt_tokens == len(prompt_ids)  # the device saw the templated history
        assert chunks[-1].usage.completion_tokens == len(expected)  # the end-of-turn token counts, unshown
        answers.append(text)
    assert answers[0] == "The capital of France is Paris."
    assert "France" in answers[1]  # "its" was resolved from the first turn


def test_completions_stay_raw_text(mesh, smollm2):
    prompt = "The capital of France is"
    ids = smollm2.tokenizer.encode(prompt, add_special_tokens=False)
    client = openai_client(mesh)
    assert [m.id for m in client.models.list()] == ["smollm2"]  # the mesh names the model it serves
    reply = client.completions.create(model="smollm2", prompt=prompt, max_tokens=6, temperature=0)
    assert reply.model == "smollm2"
    assert reply.usage.prompt_tokens == len(ids)  # no template around it
    assert reply.choices[0].text == smollm2.tokenizer.decode(
        generate_full(smollm2, ids, 6).token_ids, skip_special_tokens=True
    )


def test_ignore_eos_seed_and_text_parts_through_the_openai_client(mesh):
    """vLLM's ignore_eos runs past the end of turn to the token budget (the greedy answer first, then on);
    the same seed samples the same answer; text parts are one message."""
    client = openai_client(mesh)
    question = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}],
        }
    ]

    def ask(**fields):
        return client.chat.completions.create(model="smollm2", messages=question, **fields)

    ended = ask(max_completion_tokens=MAX_TOKENS, temperature=0)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens < MAX_TOKENS
    past = ask(max_completion_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    assert past.choices[0].finish_reason == "length" and past.usage.completion_tokens == MAX_TOKENS
    assert past.choices[0].message.content.startswith(ended.choices[0].message.content)
    sampled = [
        ask(max_tokens=12, temperature=1.0, seed=seed, extra_body={"ignore_eos": True}).choices[0]
        for seed in (1234, 1234, 1, 2)
    ]
    assert sampled[0].message.content == sampled[1].message.content  # same seed, same tokens
    assert len({c.message.content for c in sampled}) > 1  # other seeds: other samples
