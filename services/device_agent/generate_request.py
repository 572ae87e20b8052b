"""The body of POST /generate: what a client may ask of one generation on this device."""

from __future__ import annotations

from pydantic import BaseModel, Field

from services.device_agent.settings import Settings
from shared.modes import Downlink, Mode
from shared.planning.draft_budget import SHAPE_PATTERN


class ChatTurn(BaseModel):
    role: str = Field(min_length=1, max_length=32)
    content: str


class GenerateRequest(BaseModel):
    # exactly one of: raw text, token ids, or a conversation (rendered with the model's chat template)
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[ChatTurn] | None = None
    # Tokens another endpoint already generated for this request (DiSCo's token-level migration):
    # read after the prompt, never sent back; the answer goes on from them.
    prefix_ids: list[int] | None = Field(None, max_length=4096)
    prefix_text: str | None = Field(None, max_length=1 << 20)  # what the user was shown of them (see below)
    max_new_tokens: int = Field(64, ge=0, le=4096)  # 0: prefill only, with keep
    temperature: float = Field(0.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_new_tokens, past the end-of-sequence token
    request_id: str | None = None
    mode: Mode | None = None  # None: the agent's `mode` setting (shared/modes.py)
    privacy: bool | None = None  # true: refuse the token modes
    downlink: Downlink | None = None
    top_k: int | None = Field(None, ge=1, le=1000)
    stream_group: int | None = Field(None, ge=1, le=64)
    stream_window: int | None = Field(None, ge=1, le=64)
    stream_eta_gate: bool | None = None
    # Per-request overrides of the agent's feature switches (for baselines and ablations).
    speculative: bool | None = None  # SD
    prompt_chunking: bool | None = None  # PC
    chunk_size: int | None = Field(None, ge=1)  # fixed chunk size instead of the planner's
    overlap_prefill: bool | None = None
    parallel_candidates: int | None = Field(None, ge=0, le=16)  # PD
    parallel_steps: int | None = Field(None, ge=0, le=32)
    # hat: draft this request in this shape (none, chain, tree<N>: shared/planning/draft_budget.py), not the planner's
    draft_shape: str | None = Field(None, pattern=SHAPE_PATTERN)
    # Kept sessions (mode hat): keep this request's KV when it finishes; start from a kept session's KV
    # (the prompt continues its sequence).
    keep: bool = False
    fork: str | None = Field(None, min_length=1, max_length=128)
    # Edge SD (mode edge-sd): this user's uplink SNR p g / σ² in dB (the draft server's default without it)
    snr_db: float | None = Field(None, ge=-30.0, le=150.0)

    def option(self, name: str, settings: Settings):
        value = getattr(self, name)
        return getattr(settings, name) if value is None else value
