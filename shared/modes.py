"""The decoding modes a request can ask for (device agent, token streamer, bench)."""

from __future__ import annotations

from typing import Literal, get_args

# hat:       HAT, hidden states only; the device drafts, the cloud computes the middle layers (private)
# hat-async: HAT with PicoSpec's asynchronous pipeline (private)
# cloud:     the whole model in the cloud, token ids, one token per round trip (no privacy)
# token-sd:  the device drafts with its own small model, the cloud verifies token ids (no privacy)
# picospec:  token-sd with the asynchronous pipeline, streamed drafts and a sparse downlink (no privacy)
# device:    the device's draft model alone, no cloud at all (DiSCo's on-device endpoint; private)
# edge-sd:   Edge SD: an edge draft server drafts for many users in batches, the cloud verifies token ids
#            (services/device_agent/edge_server.py; no privacy)
Mode = Literal["hat", "hat-async", "cloud", "token-sd", "picospec", "device", "edge-sd"]
MODES: tuple[str, ...] = get_args(Mode)
TOKEN_MODES = frozenset({"cloud", "token-sd", "picospec", "edge-sd"})  # token ids on the wire: never for a privacy session
STREAM_MODES = frozenset({"hat-async", "token-sd", "picospec"})  # drafts as a stream (shared/specdec/stream_engine.py)
Downlink = Literal["topk", "full"]

# Where the token streamer runs a request (DiSCo, services/token_streamer/disco.py): "off" = on one
# device agent in the request's own mode; "disco" = the cost-aware policy; the rest are its baselines.
Dispatch = Literal["off", "disco", "device", "cloud", "hat", "random"]
DISPATCHES: tuple[str, ...] = get_args(Dispatch)
