"""The OpenAI wire format: request models, chunk/response builders, stop strings.

Kept apart from the app so the HTTP layer only moves events around, and so the
exact JSON shapes (which real OpenAI client libraries parse) live in one place.
Unknown request fields are accepted and ignored, as vLLM does, because clients send
many optional knobs (user, presence_penalty, ...) that this server has no use for; the
ignored names are logged (a warning the first time a set of names is seen, then debug).
docs/api-compat.md lists what each field does here.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ModelWrapValidatorHandler, field_validator, model_validator

from shared.modes import Dispatch, Downlink, Mode
from shared.planning.draft_budget import SHAPE_PATTERN

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"

Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]


_WARNED_IGNORED: set[frozenset[str]] = set()  # sets of ignored names already warned about (bounded below)
_WARNED_MAX = 256


def log_ignored(where: str, names: set[str]) -> None:
    """vLLM's warning for accepted-but-ignored fields; once per distinct set, so a client that always
    sends the same extras does not log a line per request."""
    key = frozenset(names)
    if key in _WARNED_IGNORED or len(_WARNED_IGNORED) >= _WARNED_MAX:
        log.debug("the following fields of %s were present in the request but ignored: %s", where, sorted(names))
        return
    _WARNED_IGNORED.add(key)
    log.warning("the following fields of %s were present in the request but ignored: %s", where, sorted(names))


class Lenient(BaseModel):
    """An OpenAI request object: unknown fields are accepted, ignored and logged (as vLLM does)."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="wrap")
    @classmethod
    def _log_ignored(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        result = handler(data)
        if isinstance(data, dict):
            known = set(cls.model_fields)
            ignored = {str(k) for k in data if k not in known}
            if ignored:
                log_ignored(cls.__name__, ignored)
        return result


class StreamOptions(Lenient):
    include_usage: bool = False  # continuous_usage_stats (vLLM) is ignored: usage comes once, at the end


class TophatOptions(BaseModel):
    """Per-request feature switches forwarded to the device agent (baselines, ablations).

    Unknown switches are refused rather than ignored: a benchmark that misspells a
    switch must fail, not silently measure the default."""

    model_config = ConfigDict(extra="forbid")
    speculative: bool | None = None  # SD
    prompt_chunking: bool | None = None  # PC
    chunk_size: int | None = Field(default=None, ge=1)
    overlap_prefill: bool | None = None
    parallel_candidates: int | None = Field(default=None, ge=0, le=16)  # PD
    parallel_steps: int | None = Field(default=None, ge=0, le=32)
    # hat: this request's draft shape (none, chain, tree<N>) instead of the draft budget's choice
    draft_shape: str | None = Field(default=None, pattern=SHAPE_PATTERN)
    mode: Mode | None = None  # shared/modes.py's table; its TOKEN_MODES put token ids on the wire (no privacy)
    privacy: bool | None = None  # true: refuse the token modes (the request must not leave the device as tokens)
    downlink: Downlink | None = None  # token-sd / picospec: the target row on a rejection (top-K or whole)
    top_k: int | None = Field(default=None, ge=1, le=1000)
    stream_group: int | None = Field(default=None, ge=1, le=64)  # drafts per chunk (picospec, hat-async)
    stream_window: int | None = Field(default=None, ge=1, le=64)  # most unverified drafts in flight
    stream_eta_gate: bool | None = None  # pipelined runs stop drafting ahead at a draft below eta
    # DiSCo (disco.py), answered by the streamer, never forwarded: where the request runs ("disco", a
    # baseline: "device", "cloud", "hat", "random"; "off": the request's own mode), the budget ratio b
    # and the reading rate r_c its delivery is paced at (0: unpaced).
    dispatch: Dispatch | None = None
    budget: float | None = Field(default=None, ge=0.0, le=1.0)
    reading_rate_tps: float | None = Field(default=None, ge=0.0, le=1000.0)
    migration: bool | None = None  # false: DiSCo without cost migrations (a lost cloud still hands over)
    # Jupiter's outline-based parallel decoding (outline.py), answered by the streamer, never forwarded.
    outline: bool | None = None
    # Edge SD (mode edge-sd, services/device_agent/edge_server.py): this user's uplink SNR p g / σ² in dB.
    snr_db: float | None = Field(default=None, ge=-30.0, le=150.0)
    # A known delay the streamer adds before the request starts: lets a benchmark harness prove
    # it measures what happens (see tests/loadgen/test_bench_honesty.py). Not forwarded to the device.
    added_delay_ms: float | None = Field(default=None, ge=0, le=60_000)


class SamplingRequest(Lenient):
    """Parameters shared by both endpoints (OpenAI names and defaults, vLLM's ignore_eos)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # vLLM's extension: generate to max_tokens past the end-of-sequence token
    tophat: TophatOptions | None = None  # non-OpenAI extension; OpenAI clients pass it via extra_body

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int | None) -> int:
        if n is not None and n != 1:
            raise ValueError(f"n={n} is not supported: this server returns one choice per request (n must be 1)")
        return 1

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> str | list[str] | None:
        items = [stop] if isinstance(stop, str) else (stop or [])
        if len(items) > 4 or any(not s for s in items):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stop

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def requested_tokens(self) -> int | None:
        """The most tokens to generate, as asked (None: the server's default)."""
        return self.max_tokens

    @property
    def tokens_param(self) -> str:
        """The field `requested_tokens` came from, for an error's `param`."""
        return "max_tokens"


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingRequest):
    # OpenAI's four forms, one prompt each: text, [text], token ids, [token ids]
    prompt: str | list[str] | TokenIds | list[TokenIds]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        flat_ids = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)
        if isinstance(prompt, list) and not flat_ids and len(prompt) != 1:
            raise ValueError("exactly one prompt per request is supported")
        return prompt

    @property
    def _one(self) -> str | list[int]:
        """The one prompt: its text or its token ids."""
        if isinstance(self.prompt, str):
            return self.prompt
        first = self.prompt[0]
        return [i for i in self.prompt if isinstance(i, int)] if isinstance(first, int) else first

    @property
    def prompt_text(self) -> str | None:
        """The prompt as text, or None when it came as token ids (`prompt_ids`)."""
        return self._one if isinstance(self._one, str) else None

    @property
    def prompt_ids(self) -> list[int] | None:
        """The prompt as token ids, or None when it came as text."""
        return None if isinstance(self._one, str) else list(self._one)


class ContentPart(BaseModel):
    """One part of a message's content; only text is served (a text-only model), anything else is a 400."""

    model_config = ConfigDict(extra="ignore")  # a non-text part's payload (image_url, ...) is refused, not logged
    type: str
    text: str | None = None


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: str | list[ContentPart] | None) -> str | list[ContentPart] | None:
        for part in content if isinstance(content, list) else []:
            if part.type != "text":
                raise ValueError(
                    f"content part type {part.type!r} is not supported: this model takes text only "
                    "(parts of type 'text')"
                )
            if part.text is None:
                raise ValueError("a content part of type 'text' needs its 'text'")
        return content

    @property
    def text(self) -> str:
        """The content as one string: text parts joined by newlines, as vLLM joins them."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(p.text or "" for p in self.content)


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # newer name for max_tokens

    @property
    def requested_tokens(self) -> int | None:
        """vLLM's rule: max_completion_tokens wins over max_tokens when both are given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def turns(self) -> list[dict[str, str]]:
        """The conversation as the device agent takes it; the device renders it with the model's
        own chat template (shared/chat.py), as only the device holds the tokenizer."""
        return [{"role": m.role, "content": m.text} for m in self.messages]


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_error(errors: Any) -> tuple[str, str | None]:
    """(message, param) for a 400 from pydantic's error list: the first few problems, the first field."""
    parts: list[str] = []
    param: str | None = None
    for err in list(errors)[:3]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = param or (loc[0] if loc else None)
        msg = str(err.get("msg")).removeprefix("Value error, ")  # our own validators' messages, as written
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request", param


def error_type(status: int) -> str:
    if status == 400:
        return "invalid_request_error"
    if status == 429:
        return "rate_limit_error"
    if status == 503:
        return "service_unavailable_error"
    return "server_error"


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int | None, completion_tokens: int) -> dict[str, int]:
    prompt = prompt_tokens or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


class ChunkFactory:
    """Builds every JSON object of one response, for `/v1/completions` or `/v1/chat/completions`."""

    def __init__(self, chat: bool, request_id: str, model: str) -> None:
        self.chat = chat
        self.id = request_id
        self.model = model
        self.created = int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": choices}

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if role:
                delta = {"role": "assistant", "content": text or ""}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

    def role(self) -> dict[str, Any]:
        """The first chat chunk: OpenAI announces the assistant role before any content."""
        return self._chunk([self._choice("", None, role=True)])

    def delta(self, text: str) -> dict[str, Any]:
        return self._chunk([self._choice(text, None)])

    def final(self, finish_reason: str, tophat: dict[str, Any]) -> dict[str, Any]:
        return {**self._chunk([self._choice(None, finish_reason)]), "tophat": tophat}

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        return {**self._chunk([]), "usage": usage_}

    def error_chunk(self, status: int, code: str, message: str) -> dict[str, Any]:
        """A mid-stream failure: OpenAI clients raise on a chunk carrying `error`."""
        return {**self._chunk([]), **error_body(message, error_type(status), code)}

    def response(self, text: str, finish_reason: str, usage_: dict[str, int], tophat: dict[str, Any]) -> dict[str, Any]:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        return {**self._base(obj), "choices": [choice], "usage": usage_, "tophat": tophat}


def models_list(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created)]}


def model_card(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "tophat"}


class StopScanner:
    """Cuts streamed text at the first stop string, even when it spans several deltas.

    Text that could still be the start of a stop string is held back until the
    next delta decides; `flush()` releases it when the generation ends.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Text safe to deliver now; sets `stopped` once a stop string appeared."""
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        buf = self._held + delta
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[: min(hits)]
        hold = self._partial_suffix(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best
