"""The pure parts of outline-based parallel decoding (shared/jupiter/outline.py): the router, the
outline parser, and the turn segments, checked against the real chat renderer (shared/chat.py) with
and without a chat template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from shared.chat import chat_prompt_ids, plain_chat_text
from shared.jupiter.outline import (
    MAX_POINTS,
    OUTLINE_DIRECTIVE,
    OUTLINE_OPENING,
    PLAIN_FORMAT,
    ChatFormat,
    assemble,
    chat_format,
    heading,
    parse_outline,
    route,
)
from tests.conftest import DEMO_MODEL_DIR, REPO_ROOT

ACCEPTED = [  # Vicuna-80-style generic, knowledge and counterfactual questions
    "How can I improve my time management skills?",
    "What are the most effective ways to deal with stress?",
    "Why is the sky blue?",
    "Explain the main differences between renewable and non-renewable energy sources.",
    "What would happen if the Internet had never been invented?",
    "Describe the impact of the printing press on European society.",
    "Give me some tips for a successful job interview.",
]
CODE = [
    "Write a Python function that reverses a linked list.",
    "```js\nconsole.log(1)\n```\nWhy does this print 1?",
    "def fib(n): return n if n < 2 else fib(n-1) + fib(n-2)\nWhat does this do?",
    "Implement a binary search algorithm in C++.",
    "How do I write a SQL query that joins two tables?",
    "Fix the bug in my script: for (i = 0; i < n; i++) {",
    "Explain what recursion is in programming.",
]
MATH = [
    "Solve for x: 3x + 5 = 20.",
    "What is 17 * 23?",
    "Prove that the square root of 2 is irrational.",
    "Calculate the area of a circle with radius 4.",
    "If f(x) = x^2 + 2x, what is f(3)?",
    "How many prime numbers are there between 1 and 50?",
    "Find the derivative of sin(x) times cos(x).",
]
SHORT = [
    "Who wrote Hamlet?",
    "Is water wet?",
    "What is the capital of France?",
    "Paris?",
    "In one word, how do you feel about rain?",
    "When did World War II end?",
]


@pytest.mark.parametrize("question", ACCEPTED)
def test_the_router_takes_generic_and_knowledge_questions(question: str) -> None:
    decision = route(prompt=question)
    assert (decision.use_outline, decision.reason) == (True, "open_ended")
    assert route(messages=[{"role": "user", "content": question}]).use_outline


@pytest.mark.parametrize(("questions", "reason"), [(CODE, "code"), (MATH, "math"), (SHORT, "short_answer")])
def test_the_router_declines_code_math_and_short_answers(questions: list[str], reason: str) -> None:
    assert [(q, route(prompt=q).reason) for q in questions] == [(q, reason) for q in questions]
    assert not any(route(prompt=q).use_outline for q in questions)


def test_the_router_declines_conversations_and_empty_prompts() -> None:
    question = ACCEPTED[0]
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": question},
    ]
    assert route(messages=history).reason == "conversation"
    assert (
        route(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": question}]).reason
        == "conversation"
    )
    assert route(prompt="   ").reason == "empty"


@pytest.mark.parametrize(
    ("text", "points"),
    [
        (
            "1. Rayleigh scattering\n2. Shorter wavelengths\n3. Sunsets are red",
            ["Rayleigh scattering", "Shorter wavelengths", "Sunsets are red"],
        ),
        (
            "Sure! Here is the outline:\n\n1) **Sleep schedule**:\n2) Light;\n3) Caffeine.\nHope this helps.",
            ["Sleep schedule", "Light", "Caffeine"],
        ),
        ("1: a\n2: b\n\nAnd another list:\n1. x\n2. y", ["a", "b"]),  # a break in the numbering ends the outline
        ("1. a 2. b 3. c", ["a", "b", "c"]),  # one line
        ("- apples\n- pears\n* plums", ["apples", "pears", "plums"]),
        ("1. first\n- a bullet under it\n2. second", ["first", "second"]),  # numbered lines win
        ("3. starts at three\n4. and goes on", ["starts at three", "and goes on"]),
        ("1.\n2. **\n3. real", ["real"]),  # empty points dropped
        ("The sky is blue because of 42 reasons. 1.5 million people agree.", []),
        ("", []),
        ("\x00\ufffd 1 2 3 ... )))", []),
    ],
)
def test_parse_outline(text: str, points: list[str]) -> None:
    assert parse_outline(text) == points


def test_parse_outline_bounds_the_fan_out_and_the_point_length() -> None:
    text = "\n".join(f"{i}. point {i} " + "x" * 500 for i in range(1, 30))
    points = parse_outline(text)
    assert len(points) == MAX_POINTS and all(len(p) <= 160 for p in points)


def test_without_a_template_the_segments_are_the_plain_rendering() -> None:
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    fmt = chat_format(tokenizer)
    assert fmt == PLAIN_FORMAT
    question, outline = "Why is the sky blue?", " 1. a\n2. b"
    assert fmt.directive_text() + fmt.question_text(question) == plain_chat_text(
        [{"role": "system", "content": OUTLINE_DIRECTIVE}, {"role": "user", "content": question}]
    )
    point = fmt.point_text(2, "b", outline_ended_turn=False)
    assert point.startswith('\nuser: Now write the part of the answer for point 2 of your outline, "b"')
    assert (fmt.directive_text() + fmt.question_text(question) + outline + point).endswith("\nassistant:")


@pytest.fixture()
def chatml_tokenizer():
    """The demo tokenizer with SmolLM2's chat template and end-of-turn token."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = (REPO_ROOT / "models" / "smollm2" / "chat_template.jinja").read_text()
    return tokenizer


def test_with_a_template_the_segments_concatenate_to_its_rendering(chatml_tokenizer) -> None:
    fmt = chat_format(chatml_tokenizer)
    assert fmt.end_of_turn == "<|im_end|>" and fmt.system_open == "<|im_start|>system\n"
    question, outline = "Why is the sky blue?", "1. Scattering\n2. Sunsets"
    conversation = [
        {"role": "system", "content": OUTLINE_DIRECTIVE},
        {"role": "user", "content": question},
        {"role": "assistant", "content": outline},
        {
            "role": "user",
            "content": fmt.point_text(1, "Scattering", outline_ended_turn=False)[
                len(fmt.assistant_to_user) : -len(fmt.user_to_assistant)
            ],
        },
    ]
    rendered = chatml_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    segments = (
        fmt.directive_text()
        + fmt.question_text(question)
        + outline
        + fmt.point_text(1, "Scattering", outline_ended_turn=False)
    )
    assert segments == rendered
    # An outline that ended on <|im_end|> holds it already: the point's segment does not repeat it.
    ended = fmt.point_text(1, "Scattering", outline_ended_turn=True)
    assert outline + "<|im_end|>" + ended == outline + fmt.point_text(1, "Scattering", outline_ended_turn=False)
    assert chat_prompt_ids(chatml_tokenizer, conversation[:2]) == chatml_tokenizer.encode(
        fmt.directive_text() + fmt.question_text(question), add_special_tokens=False
    )


def test_a_chat_format_from_a_peer_is_validated() -> None:
    assert ChatFormat.from_dict(PLAIN_FORMAT.to_dict()) == PLAIN_FORMAT
    assert ChatFormat.from_dict({"system_open": 3}) is None
    assert ChatFormat.from_dict("chatml") is None
    assert ChatFormat.from_dict({"system_open": "x" * 5000}) is None


def test_the_answer_is_the_points_in_order_behind_their_headings() -> None:
    assert heading(1, "a") == "1. a\n" and heading(2, "b") == "\n\n2. b\n"
    assert assemble(["a", "b"], [" first. ", "second."]) == "1. a\nfirst.\n\n2. b\nsecond."


def test_repeated_points_are_dropped_and_the_model_continues_the_opening():
    # what SmolLM2 writes after the primed "1." (measured): repeats, and a list running past five points
    written = " Improved health\n2. Better sleep\n3. Improved health\n4. More energy\n5. Better sleep\n6. Less stress\n"
    assert parse_outline(OUTLINE_OPENING + written) == ["Improved health", "Better sleep", "More energy", "Less stress"]
