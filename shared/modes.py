"""The decoding modes a request can ask for, as one table (device agent, token streamer, bench, simulator).

Each row says what the device builds for the mode, which rounds loop runs it, what it needs and what it
puts on the wire; `ModeSpec.refusal` says why a request cannot have it. Everything else (the `Mode`
names, `TOKEN_MODES`, `STREAM_MODES`, the bench's verifier settings) is read from the table, so adding a
mode touches the table, its rounds loop (services/device_agent/rounds.py) and their tests.

This is the bottom layer: it names session kinds and rounds loops by string; the device agent maps them
to its classes and loops in one place (services/device_agent/rounds.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# What the device builds for a request: "split" a DeviceSession (HAT's U-shaped split), "stream" a
# StreamSession (drafts as a stream), "local" a LocalSession (the draft model alone), "none" nothing
# (the whole model runs in the cloud; the device only tokenizes).
SessionKind = Literal["split", "stream", "local", "none"]
# Which loop turns the session into verified tokens.
Rounds = Literal["hat", "hat-async", "token-stream", "edge", "local", "cloud"]
# What leaves the device: hidden states (private: no token id leaves it), token ids (no privacy), nothing.
Uplink = Literal["hidden", "tokens", "none"]

STREAM_ROUNDS = frozenset({"hat-async", "token-stream"})  # shared/specdec/stream_engine.py's loops


@dataclass(frozen=True)
class Refusal:
    """Why a request cannot run in the mode it asked for: the device agent's HTTP error."""

    code: str
    message: str
    status: int = 400
    detail: tuple[tuple[str, str], ...] = ()  # more fields of the error body


@dataclass(frozen=True)
class Asked:
    """What a request asks of its mode."""

    privacy: bool = False  # no token id may leave the device
    keep_or_fork: bool = False  # keep the KV when done, or start from a kept session's
    speculative: bool = False  # SD on (the request's switch, else the agent's)


@dataclass(frozen=True)
class Offered:
    """What the device agent has to run a mode with."""

    draft_adapter: bool = False
    max_draft: int = 0  # the agent's draft length; 0 drafts nothing even with SD on
    edge_server: bool = False  # it runs an Edge SD draft server


@dataclass(frozen=True)
class ModeSpec:
    """One mode: what runs where, what it needs, what it sends."""

    name: str
    session: SessionKind
    rounds: Rounds
    uplink: Uplink
    summary: str
    keepable: bool = False  # keep / fork (services/device_agent/kept.py) work in this mode
    needs_drafting: bool = False  # SD on, a draft adapter and max_draft > 0
    needs_edge_server: bool = False  # an edge draft server with a draft adapter
    needs_draft_model: bool = False  # a draft adapter (the draft model generates on its own)
    unmet: str = ""  # the refusal when a need above is unmet

    def __post_init__(self) -> None:
        if self.session not in get_args(SessionKind) or self.rounds not in get_args(Rounds):
            raise ValueError(f"mode {self.name}: unknown session kind {self.session!r} or rounds {self.rounds!r}")
        if self.uplink not in get_args(Uplink):
            raise ValueError(f"mode {self.name}: unknown uplink {self.uplink!r}")
        needs = self.needs_drafting or self.needs_edge_server or self.needs_draft_model
        if needs != bool(self.unmet):
            raise ValueError(f"mode {self.name}: a mode with needs says why they are unmet, and only then")
        if self.session == "none" and needs:
            raise ValueError(f"mode {self.name}: a mode without a device session needs nothing of the device")

    @property
    def private(self) -> bool:
        """Whether a privacy request may use it: no token id leaves the device."""
        return self.uplink != "tokens"

    @property
    def verifier_full_model(self) -> bool:
        """Whether the verifier must run the whole model (TOPHAT_VERIFIER_FULL_MODEL): token ids need its
        embeddings and head, hidden states only its middle layers."""
        return self.uplink == "tokens"

    @property
    def uses_device_model(self) -> bool:
        """Whether the device computes (so the SD / PC / PD switches and a slowdown apply)."""
        return self.session != "none"

    def refusal(self, asked: Asked, offered: Offered) -> Refusal | None:
        """Why this mode cannot serve the request on this device (None: it can). Checked in this order, so
        a request with several problems always hears about the same one."""
        if asked.keep_or_fork and not self.keepable:
            keepable = " or ".join(name for name, spec in MODE_TABLE.items() if spec.keepable)
            return Refusal(
                "kept_sessions_unsupported",
                f"keep and fork work in mode {keepable} only, not {self.name}",
                detail=(("mode", self.name),),
            )
        if asked.privacy and not self.private:
            private = " or ".join(name for name, spec in MODE_TABLE.items() if spec.uplink == "hidden")
            return Refusal(
                "privacy",
                f"mode {self.name} sends token ids to the cloud; this request asked for privacy (use {private})",
            )
        if not self.uses_device_model:  # SD / PC / PD do not apply
            return None
        if asked.speculative and not offered.draft_adapter:
            return Refusal("bad_request", "this device runs without a draft adapter (speculative=false)")
        drafting = asked.speculative and offered.max_draft > 0 and offered.draft_adapter
        if (
            (self.needs_drafting and not drafting)
            or (self.needs_edge_server and not (offered.edge_server and offered.draft_adapter))
            or (self.needs_draft_model and not offered.draft_adapter)
        ):
            return Refusal("bad_request", self.unmet)
        return None


MODE_TABLE: dict[str, ModeSpec] = {
    spec.name: spec
    for spec in (
        ModeSpec(
            "hat",
            "split",
            "hat",
            "hidden",
            keepable=True,
            summary="HAT: the device drafts, the cloud computes the middle layers (SD / PC / PD switches)",
        ),
        ModeSpec(
            "hat-async",
            "stream",
            "hat-async",
            "hidden",
            needs_drafting=True,
            unmet="mode hat-async drafts: it needs speculative=true and a draft adapter",
            summary="HAT with PicoSpec's asynchronous pipeline",
        ),
        ModeSpec(
            "cloud",
            "none",
            "cloud",
            "tokens",
            summary="the whole model in the cloud, one token per round trip (HAT's cloud baseline)",
        ),
        ModeSpec(
            "token-sd",
            "stream",
            "token-stream",
            "tokens",
            needs_drafting=True,
            unmet="mode token-sd drafts: it needs speculative=true and a draft adapter",
            summary="the device drafts with its own small model, the cloud verifies token ids",
        ),
        ModeSpec(
            "picospec",
            "stream",
            "token-stream",
            "tokens",
            needs_drafting=True,
            unmet="mode picospec drafts: it needs speculative=true and a draft adapter",
            summary="token-sd with the asynchronous pipeline, streamed drafts and a sparse downlink",
        ),
        ModeSpec(
            "device",
            "local",
            "local",
            "none",
            needs_draft_model=True,
            unmet="mode device generates with the draft model: this device has none",
            summary="the device's draft model alone, no cloud at all (DiSCo's on-device endpoint)",
        ),
        ModeSpec(
            "edge-sd",
            "stream",
            "edge",
            "tokens",
            needs_edge_server=True,
            unmet="mode edge-sd needs an edge draft server (TOPHAT_DEVICE_EDGE_DRAFT_SERVER) with a draft adapter",
            summary="Edge SD: an edge draft server drafts for many users in batches, the cloud verifies token ids",
        ),
    )
}

# The names a request may use (pydantic checks them); the table's keys, in its order.
Mode = Literal["hat", "hat-async", "cloud", "token-sd", "picospec", "device", "edge-sd"]
MODES: tuple[str, ...] = tuple(MODE_TABLE)
TOKEN_MODES = frozenset(name for name, spec in MODE_TABLE.items() if not spec.private)  # never for privacy
STREAM_MODES = frozenset(name for name, spec in MODE_TABLE.items() if spec.rounds in STREAM_ROUNDS)
# The mode whose requests may keep and fork sessions (the streamer's outline decoding runs in it).
KEPT_SESSIONS_MODE = next(name for name, spec in MODE_TABLE.items() if spec.keepable)
if MODES != get_args(Mode):  # the Literal is spelled out for type checkers; the table is the truth
    raise ImportError("shared/modes.py: the Mode literal and MODE_TABLE name different modes")

Downlink = Literal["topk", "full"]

# Where the token streamer runs a request (DiSCo, services/token_streamer/disco.py): "off" = on one
# device agent in the request's own mode; "disco" = the cost-aware policy; the rest are its baselines.
Dispatch = Literal["off", "disco", "device", "cloud", "hat", "random"]
DISPATCHES: tuple[str, ...] = get_args(Dispatch)
