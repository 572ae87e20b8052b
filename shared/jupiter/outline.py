"""Outline-based parallel decoding (Jupiter §V-B): the pure parts.

The flow (services/token_streamer/outline.py) asks the model for a short numbered outline
after a fixed directive, parses the points, then expands every point as its own request
forked from the outline's KV, and concatenates the expansions in order. This module holds
what needs no network: the directive and the point instruction, the router that decides
whether a question suits the method, the outline parser, and the text segments each
request appends to the kept sequence before it:

    [directive prefix]                      prefilled once per device, kept (max_new_tokens 0)
      -> fork -> [question turn + assistant]  generates the outline, kept
        -> fork per point -> [expand point i turn + assistant]  generates the answer to point i

The segments follow the checkpoint's chat template (`ChatFormat`, derived from the
tokenizer where the tokenizer lives, the device agent, and sent to the streamer in /info):
each piece is the template's own text between two turn contents, so the concatenation is
the template's rendering of the conversation [system: directive, user: question,
assistant: outline, user: expand point i] up to the assistant's next turn.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)

OUTLINE_DIRECTIVE = (
    "Before answering, plan. Reply with only a short numbered outline of the answer to the user's "
    "question: 3 to 5 points, one per line, numbered 1., 2., 3. and so on, each point a few words "
    "(no full sentences, no explanations). Do not write the answer itself."
)

POINT_INSTRUCTION = (
    'Now write the part of the answer for point {index} of your outline, "{point}", in one or two '
    "sentences. Write only about this point; the other points are answered separately."
)

MAX_POINTS = 5  # bounds the fan-out whatever the model writes (the directive asks for 3-5)
# The assistant's outline turn starts with this, written for the model: a small model (SmolLM2-135M) ignores
# the directive and answers in prose, but continues a numbered list it is put inside (Skeleton-of-Thought
# primes its skeleton the same way). The parser reads it back in front of what the model wrote.
OUTLINE_OPENING = "1."
MAX_POINT_CHARS = 160
MIN_POINTS = 2  # fewer: nothing to run in parallel, the caller answers sequentially


# -- the router -----------------------------------------------------------------------------------
# Heuristics, on the text of the question only. Jupiter's quality table (Vicuna-80) shows generic,
# knowledge and counterfactual questions keep their quality under outline decoding while coding and
# math lose it (chained, step-by-step dependencies); the paper also names short-answer tasks. A false
# decline costs only speed (the sequential path answers exactly), a false accept costs quality, so
# every doubtful signal declines.

_CODE_PATTERNS = [
    re.compile(p, re.IGNORECASE)
    for p in (
        r"```",
        r"\bdef\s+\w+\s*\(",
        r"\bclass\s+\w+\s*[:({]",
        r"\bfunction\s*\w*\s*\(",
        r"#include\b",
        r"^\s*(import|from)\s+\w+",
        r"\bconsole\.log\b",
        r"\bprintf?\s*\(",
        r"=>",
        r"\w+\([^()\n]*\)\s*[{;]",
        r"[{};]\s*$",
        r"\b(write|implement|code|create|build|debug|fix|refactor)\b.{0,40}\b(program|script|function|"
        r"method|class|code|query|regex|algorithm|snippet|api|app)\b",
        r"\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|kotlin|swift|sql|bash|html|css|regex|"
        r"programming|coding|compiler|source code|stack trace|segfault|recursion|pseudocode)\b",
        r"\b\w+_\w+\b",  # snake_case identifiers
    )
]

_MATH_PATTERNS = [
    re.compile(p, re.IGNORECASE)
    for p in (
        r"\d\s*[-+*/^×÷=<>%]\s*\(?\s*\d",
        r"\b\d*[a-z]\s*\^\s*\d",
        r"\b\d+[a-z]\b\s*[-+=]",
        r"[a-z]\s*=\s*-?\d",
        r"\b(solve|calculate|compute|evaluate|simplify|prove|proof|derive|equation|inequality|"
        r"integral|integrate|derivative|differentiate|theorem|lemma|arithmetic|algebra|geometry|probability|"
        r"factorial|sqrt|logarithm|polynomial|matrix|how many|how much|percent(age)?|sum of|product of|"
        r"remainder|divisible|prime number|math|maths|mathematics)\b",
        r"[∫∑√π≤≥≠]",
    )
]

# A question that wants a fact, a yes/no or a one-liner has no outline worth running in parallel.
_SHORT_EXPLICIT = re.compile(
    r"\b(in one word|one word|in a word|one sentence|single sentence|briefly|yes or no|true or false|"
    r"short answer|just the (name|number|answer))\b",
    re.IGNORECASE,
)
_SHORT_OPENERS = re.compile(
    r"^\s*(who|when|where|which|is|are|was|were|do|does|did|can|could|will|would|should|has|have|had|"
    r"what (year|time|day|date|color|colour|is the (capital|name|date|population)))\b",
    re.IGNORECASE,
)
_OPEN_ENDED = re.compile(
    r"\b(how|why|explain|describe|discuss|compare|contrast|list|tips|ways|steps|advice|suggest|"
    r"advantages|disadvantages|benefits|pros|cons|overview|impact|effects?|causes?|strategies|plan|"
    r"what are|what would|imagine|essay|write)\b",
    re.IGNORECASE,
)
MIN_WORDS = 4


@dataclass(frozen=True)
class RouteDecision:
    use_outline: bool
    reason: str  # accepted: "open_ended"; declined: "empty", "conversation", "code", "math", "short_answer"


def question_of(prompt: str | None = None, messages: Sequence[Mapping[str, Any]] | None = None) -> str | None:
    """The single question the outline answers, or None when the chat is not one user turn
    (history, a system prompt of the user's, an assistant turn: its answer may depend on them)."""
    if messages is not None:
        if len(messages) != 1 or messages[0].get("role") != "user" or not isinstance(messages[0].get("content"), str):
            return None
        return str(messages[0]["content"])
    return prompt


def route(prompt: str | None = None, messages: Sequence[Mapping[str, Any]] | None = None) -> RouteDecision:
    """Whether outline decoding suits this request (heuristics; see the comment above)."""
    if messages is not None and question_of(messages=messages) is None:
        return RouteDecision(False, "conversation")
    text = (question_of(prompt, messages) or "").strip()
    if not text:
        return RouteDecision(False, "empty")
    if any(p.search(line) for p in _CODE_PATTERNS for line in text.splitlines() or [text]):
        return RouteDecision(False, "code")
    if any(p.search(text) for p in _MATH_PATTERNS):
        return RouteDecision(False, "math")
    words = len(text.split())
    if (
        _SHORT_EXPLICIT.search(text)
        or words < MIN_WORDS
        or (_SHORT_OPENERS.search(text) and not _OPEN_ENDED.search(text))
    ):
        return RouteDecision(False, "short_answer")
    return RouteDecision(True, "open_ended")


# -- the outline parser -----------------------------------------------------------------------------

_NUMBERED = re.compile(r"^\s*(?:\*\*)?\(?(\d{1,2})\s*[.):](?!\d)\s*(.*)$")
_BULLET = re.compile(r"^\s*[-*•]\s+(.*)$")
_INLINE_NUMBER = re.compile(r"(?:^|\s)(\d{1,2})[.)]\s+")


def _clean(point: str) -> str:
    point = re.sub(r"[*_`#]+", "", point).strip().rstrip(":;,.").strip()
    return point[:MAX_POINT_CHARS].strip()


def parse_outline(text: str) -> list[str]:
    """The points of a numbered ("1." / "1)" / "1:") or bulleted ("- ") outline, in order.

    Numbered lines win over bullets. Numbering must go up by one from the first point; the list
    ends at a break in it (a second list, a stray number), which keeps junk the model writes after
    the outline out. An outline written on one line ("1. a 2. b 3. c") is split too. Empty points
    are dropped, each is trimmed of markdown and cut to MAX_POINT_CHARS, at most MAX_POINTS come
    back. Nothing recognisable: [] (the caller answers sequentially)."""
    lines = text.splitlines()
    numbered: list[str] = []
    expected: int | None = None
    for line in lines:
        match = _NUMBERED.match(line)
        if match is None:
            continue
        number = int(match.group(1))
        if expected is not None and number != expected:
            break
        expected = number + 1
        numbered.append(match.group(2))
    points = [p for p in map(_clean, numbered) if p]
    if len(points) < MIN_POINTS and len(lines) <= 2:
        points = [p for p in map(_clean, _inline_points(text)) if p] or points
    if not points:
        points = [p for p in (_clean(m.group(1)) for m in map(_BULLET.match, lines) if m) if p]
    unique = list(dict.fromkeys(points))  # a small model repeats itself; a repeated point adds nothing
    return unique[:MAX_POINTS]


def _inline_points(text: str) -> list[str]:
    """'1. a 2. b 3. c' -> [a, b, c], following the numbering from 1 (other numbers stay in the text)."""
    points, expected, start = [], 1, None
    for match in _INLINE_NUMBER.finditer(text):
        if int(match.group(1)) != expected:
            continue
        if start is not None:
            points.append(text[start : match.start()])
        start, expected = match.end(), expected + 1
    if start is not None:
        points.append(text[start:])
    return points


# -- the turns --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatFormat:
    """The chat template's text around turn contents (one-question conversations only).

    render([system: S, user: Q]) + generation prompt == system_open + S + system_to_user + Q + user_to_assistant;
    an assistant answer A followed by a user turn U renders A + assistant_to_user + U + user_to_assistant.
    `end_of_turn` is the part of assistant_to_user the model generates itself (its eos text, e.g.
    ChatML's '<|im_end|>'): a kept outline that finished on eos already holds it."""

    system_open: str
    system_to_user: str
    user_to_assistant: str
    assistant_to_user: str
    end_of_turn: str = ""

    def directive_text(self) -> str:
        """Segment 1: the fixed prefix every outline forks (prefilled once per device)."""
        return self.system_open + OUTLINE_DIRECTIVE + self.system_to_user

    def question_text(self, question: str) -> str:
        """Segment 2, after the directive: the question's turn and the assistant's turn opening."""
        return question + self.user_to_assistant

    def point_text(self, index: int, point: str, *, outline_ended_turn: bool) -> str:
        """Segment 3 for point `index` (1-based), after the kept outline. `outline_ended_turn`: the
        outline finished on the model's end of turn, which the kept sequence then already holds."""
        between = self.assistant_to_user
        if outline_ended_turn and self.end_of_turn and between.startswith(self.end_of_turn):
            between = between[len(self.end_of_turn) :]
        return between + POINT_INSTRUCTION.format(index=index, point=point) + self.user_to_assistant

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ChatFormat | None:
        """From a peer's JSON (the device agent's /info); None for anything malformed."""
        if not isinstance(data, dict):
            return None
        fields = ("system_open", "system_to_user", "user_to_assistant", "assistant_to_user", "end_of_turn")
        values = {name: data.get(name, "") for name in fields}
        if not all(isinstance(v, str) and len(v) <= 1024 for v in values.values()):
            return None
        return cls(**values)


# The no-template rendering of shared/chat.py (plain_chat_text): 'role: content' lines, then 'assistant:'.
PLAIN_FORMAT = ChatFormat(
    system_open="system: ", system_to_user="\nuser: ", user_to_assistant="\nassistant:", assistant_to_user="\nuser: "
)

_SENTINELS = ("\u2063S\u2063", "\u2063Q\u2063", "\u2063A\u2063", "\u2063U\u2063")


class ChatFormatError(ValueError):
    """The template does not render turn contents verbatim between fixed texts."""


def chat_format(tokenizer: Any) -> ChatFormat:
    """The segments of `tokenizer`'s chat template (PLAIN_FORMAT without one), found by rendering a
    conversation of sentinel contents and cutting around them; checked against a real rendering."""
    from shared.chat import has_chat_template

    if tokenizer is None or not has_chat_template(tokenizer):
        return PLAIN_FORMAT
    s, q, a, u = _SENTINELS
    text = _render(tokenizer, [("system", s), ("user", q), ("assistant", a), ("user", u)])
    cuts = [text.find(x) for x in _SENTINELS]
    if min(cuts) < 0 or cuts != sorted(cuts) or any(text.count(x) != 1 for x in _SENTINELS):
        raise ChatFormatError("the chat template does not render message contents verbatim")
    between_a_u = text[cuts[2] + len(a) : cuts[3]]
    eos = getattr(tokenizer, "eos_token", None) or ""
    fmt = ChatFormat(
        system_open=text[: cuts[0]],
        system_to_user=text[cuts[0] + len(s) : cuts[1]],
        user_to_assistant=text[cuts[3] + len(u) :],
        assistant_to_user=between_a_u,
        end_of_turn=eos if eos and between_a_u.startswith(eos) else "",
    )
    # The opening of an assistant turn after the first user turn must be the same as after the last.
    if text[cuts[1] + len(q) : cuts[2]] != fmt.user_to_assistant:
        raise ChatFormatError("the chat template opens assistant turns differently by position")
    check = _render(tokenizer, [("system", OUTLINE_DIRECTIVE), ("user", "Why is the sky blue?")])
    if check != fmt.directive_text() + fmt.question_text("Why is the sky blue?"):
        raise ChatFormatError("the chat template's rendering is not the segments' concatenation")
    return fmt


def _render(tokenizer: Any, turns: list[tuple[str, str]]) -> str:
    messages = [{"role": role, "content": content} for role, content in turns]
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


# -- the answer ---------------------------------------------------------------------------------------


def heading(index: int, point: str) -> str:
    """What goes before point `index`'s expansion in the answer (a blank line between points)."""
    return ("" if index == 1 else "\n\n") + f"{index}. {point}\n"


def assemble(points: Sequence[str], answers: Sequence[str]) -> str:
    """The final answer: each point's heading, then its expansion, in outline order."""
    return "".join(heading(i, p) + a.strip() for i, (p, a) in enumerate(zip(points, answers, strict=True), 1))


def advertised_chat_format(tokenizer: Any) -> dict[str, str] | None:
    """What a device agent's /info says about its template (None: outlines are not offered)."""
    if tokenizer is None:  # prompts come as ids only: no text segments to send
        return None
    try:
        return chat_format(tokenizer).to_dict()
    except (ChatFormatError, ValueError) as exc:  # a template that refuses the sentinel conversation
        log.info("no outline chat format for this tokenizer: %s", exc)
        return None
