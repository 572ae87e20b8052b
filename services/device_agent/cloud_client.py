"""The device's side of the WebSocket to verifier-cloud: a `Cloud` over the wire.

One connection per device agent, shared by all its sessions (cloud_connection.py: replicas, the reader,
replies matched to requests by (session_id, seq_no), every wait bounded by `request_timeout_s`). If the
connection drops, every waiting request fails with `CloudUnavailable` and the next request reconnects.

Besides the hidden-state protocol of HAT mode it speaks token mode (no privacy) with a
verifier started with TOPHAT_VERIFIER_FULL_MODEL: token_mode.py's `token_decode` (HAT's
"cloud" baseline) and streamed token drafts. How a call fails: cloud_errors.py.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence

import torch
from websockets.asyncio.client import ClientConnection

from services.device_agent.cloud_connection import SESSION_SEQ, CloudConnection, FrameHook
from services.device_agent.cloud_errors import CloudError, CloudUnavailable
from services.device_agent.token_mode import chunk_verdict
from shared.auth.client import BrokerAuth
from shared.net.links import LinkProfile
from shared.specdec.draft_stream import ChunkVerdict, DraftChunk
from shared.specdec.sampling import SamplingParams
from shared.specdec.separate_rejection import Downlink
from shared.specdec.verify_layout import VerifyLayout
from shared.wire import schema as wire

log = logging.getLogger("services.device_agent.cloud")

_U64_MASK = 2**64 - 1

TransferHook = Callable[[str, int, float], None]  # (direction "up"/"down", bytes, seconds)


class WebSocketCloud(CloudConnection):
    def __init__(
        self,
        url: str,
        hidden_size: int,
        wire_dtype: wire.WireDtype = wire.WireDtype.F16,
        request_timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        max_frame_bytes: int = wire.MAX_FRAME_BYTES,
        on_transfer: TransferHook | None = None,
        link: LinkProfile | None = None,
        *,
        split_layers: int | None = None,
        fingerprint: int | None = None,
        on_frame: FrameHook | None = None,
        tls_ca: str = "",
        auth: BrokerAuth | None = None,
    ):
        """`split_layers` (m) and `fingerprint` (`split_fingerprint(checkpoint_dir, m)`) go with every
        OpenSession so a verifier with another split or checkpoint refuses it; without them only
        token-mode sessions can be opened. `url` may list several verifier replicas, comma-separated: a
        connection goes to the first that answers, and after one closes the next is tried first."""
        super().__init__(
            url, wire_dtype, request_timeout_s, connect_timeout_s, max_frame_bytes, link, on_frame, tls_ca, auth
        )
        self.hidden_size = hidden_size
        self.split_layers = split_layers
        self.fingerprint = fingerprint
        self.on_transfer = on_transfer
        # Readiness: the connection on which the verifier last accepted this device's split identity (read by
        # /readyz, no network call there; why the device is not ready when it is not: `not_ready_reason`).
        self._accepted_on: ClientConnection | None = None
        self.split_refused = False  # the last check met SPLIT_MISMATCH: a configuration error

    # -- readiness --------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Connected, and this connection's verifier accepted the split identity (a cached answer)."""
        return self.connected and self._accepted_on is self._connection

    async def check_ready(self, timeout_s: float) -> bool:
        """Make `ready` current: (re)connect and, once per connection, open and close a throwaway
        session, which the verifier answers with SPLIT_MISMATCH before anything else when the split or
        checkpoint differ. Any other refusal (full, busy) still means the identity was accepted.
        Bounded by `timeout_s`; the reason for a False is in `not_ready_reason`."""
        if self.ready:
            return True
        try:
            async with asyncio.timeout(timeout_s):
                connection = await self._ensure_connected()
                session_id = random.getrandbits(63)
                try:
                    await self.open(session_id)
                except CloudError as exc:
                    if exc.code == wire.ErrorCode.SPLIT_MISMATCH:
                        raise
                else:
                    await self.close(session_id)
        except CloudError as exc:
            self.not_ready_reason = f"the verifier at {self.url} refused this device: {exc.detail}"
            self.split_refused = True
            return False
        except (CloudUnavailable, TimeoutError) as exc:
            self.not_ready_reason = f"the verifier at {self.url} is unreachable: {exc or type(exc).__name__}"
            return False
        self._accepted_on, self.split_refused = connection, False
        return self.ready

    # -- link probes ------------------------------------------------------------------
    async def _probe_rtt(self, up_rows: int, down_rows: int) -> float:
        seq_no = next(self._seq)
        padding = torch.zeros(up_rows, self.hidden_size, dtype=torch.float16)
        started = time.perf_counter()
        await self._request(wire.BandwidthProbe(0, seq_no, down_rows, padding), (0, seq_no))
        return time.perf_counter() - started

    async def measure_rtt(self) -> float:
        """Seconds for a one-row message to the verifier and back (the better of two)."""
        return min([await self._probe_rtt(1, 1) for _ in range(2)])

    async def measure_link(self, rows: int = 128) -> tuple[tuple[int, float], tuple[int, float], float]:
        """(bytes, seconds) of one bulk upload and one bulk download over the live connection,
        and the round trip of a one-row message.

        Uplink: a bulk-up probe's round trip minus a tiny probe's is the time the extra rows took
        going up (latency and framing cancel out). Downlink: the verifier never answers a probe
        with more rows than it carried (no amplification), so the bulk-down probe carries `rows`
        up too, and its round trip minus the bulk-up probe's (same upload, one row back) is the
        time the extra rows took coming down. The tiny round trip is latency both ways plus both
        ends' framing and event-loop time."""
        base = await self.measure_rtt()
        extra = (rows - 1) * self.hidden_size * 2
        bulk_up = await self._probe_rtt(rows, 1)
        bulk_both = await self._probe_rtt(rows, rows)
        return (extra, max(bulk_up - base, 1e-6)), (extra, max(bulk_both - bulk_up, 1e-6)), base

    # -- the Cloud protocol ------------------------------------------------------------
    async def open(self, session_id: int) -> None:
        if self.split_layers is None or self.fingerprint is None:
            raise ValueError(
                "this WebSocketCloud was built without split_layers and fingerprint: it can open "
                "token-mode sessions only"
            )
        message = wire.OpenSession(
            session_id,
            self.hidden_size,
            wire.WireDtype(self.wire_dtype),
            True,
            split_layers=self.split_layers,
            fingerprint=self.fingerprint,
        )
        try:
            await self._request(message, (session_id, SESSION_SEQ))
        except CloudError as exc:
            if exc.code != wire.ErrorCode.SPLIT_MISMATCH:
                raise
            log.error("the verifier at %s serves another split or checkpoint: %s", self.url, exc)
            raise CloudError(
                exc.code,
                f"{exc.detail} (this device: split at layer "
                f"{self.split_layers}, checkpoint fingerprint {self.fingerprint:016x}); start both "
                "with the same model directory and split",
            ) from None

    async def fork(self, session_id: int, parent_id: int, length: int) -> None:
        """Open `session_id` as a copy of the first `length` positions of `parent_id` (a session of this
        connection with nothing in flight): the verifier copies that KV instead of computing it again."""
        await self._request(wire.ForkSession(session_id, parent_id, length), (session_id, SESSION_SEQ))

    async def send_prefill(self, session_id: int, start_pos: int, shallow: torch.Tensor, is_last: bool):
        seq_no = next(self._seq)
        key = (session_id, seq_no)
        future = await self._send(wire.PrefillChunk(session_id, seq_no, start_pos, is_last, shallow), key)

        async def answer() -> torch.Tensor | None:
            reply = await self._wait(future, key)
            return reply.hidden.float() if isinstance(reply, wire.DeepHidden) else None

        return asyncio.ensure_future(answer())

    async def verify(
        self, session_id: int, commit_len: int, shallow: torch.Tensor, layout: VerifyLayout | None = None
    ) -> torch.Tensor:
        seq_no = next(self._seq)
        parents, kept = (None, None) if layout is None else (layout.parents, layout.kept)
        request = wire.VerifyRequest(session_id, seq_no, commit_len, shallow, parents, kept)
        reply = await self._request(request, (session_id, seq_no))
        return _deep_hidden(reply)  # [k+1, H]

    async def send_verify(self, session_id: int, commit_len: int, shallow: torch.Tensor):
        """`verify` returning once the frame is sent: pipelined chunks go up in order, answers come later."""
        seq_no = next(self._seq)
        key = (session_id, seq_no)
        future = await self._send(wire.VerifyRequest(session_id, seq_no, commit_len, shallow), key)

        async def answer() -> torch.Tensor:
            reply = await self._wait(future, key)
            return _deep_hidden(reply)  # [n, H]

        return asyncio.ensure_future(answer())

    async def close(self, session_id: int) -> None:
        if self._connection is None or self._reader is None or self._reader.done():
            return  # the cloud already dropped every session of the lost connection
        try:
            await self._request(wire.CloseSession(session_id), (session_id, SESSION_SEQ))
        except (CloudUnavailable, CloudError) as exc:
            log.info("closing session %d: %s", session_id, exc)

    # -- token mode (HAT's "cloud" baseline: token ids on the wire, no privacy) -----------------
    async def open_token_session(self, session_id: int, params: SamplingParams) -> None:
        # torch seeds a generator with a negative seed as its two's complement; the wire carries a u64
        seed = None if params.seed is None else params.seed & _U64_MASK
        await self._request(
            wire.OpenTokenSession(session_id, float(params.temperature), float(params.top_p), seed),
            (session_id, SESSION_SEQ),
        )

    async def _next_token(self, message: wire.TokenPrefill | wire.TokenStep) -> int:
        reply = await self._request(message, (message.session_id, message.seq_no))
        if not isinstance(reply, wire.TokenResult) or len(reply.token_ids) != 1:
            raise CloudError(wire.ErrorCode.MALFORMED, f"expected one sampled token, got {reply!r}"[:200])
        return reply.token_ids[0]

    async def token_prefill(self, session_id: int, token_ids: Sequence[int]) -> int:
        """Upload the whole prompt's ids; returns the first generated token."""
        return await self._next_token(wire.TokenPrefill(session_id, next(self._seq), tuple(token_ids)))

    async def token_step(self, session_id: int, commit_len: int, token_ids: Sequence[int]) -> int:
        """Keep `commit_len` cached positions, append `token_ids`; returns the next token."""
        return await self._next_token(wire.TokenStep(session_id, next(self._seq), commit_len, tuple(token_ids)))

    async def send_token_chunk(
        self, session_id: int, chunk: DraftChunk, downlink: Downlink, top_k: int
    ) -> Awaitable[ChunkVerdict]:
        """Upload one chunk of a streamed draft; returns once it is sent, with an awaitable of its verdict."""
        seq_no = next(self._seq)
        key = (session_id, seq_no)
        message = wire.TokenDraft(
            session_id,
            seq_no,
            chunk.epoch,
            chunk.start_pos,
            chunk.tokens,
            chunk.num_final,
            chunk.more,
            0 if downlink == "full" else top_k,
            chunk.q_drafted,
        )
        future = await self._send(message, key)

        async def answer() -> ChunkVerdict:
            reply = await self._wait(future, key)
            if not isinstance(reply, wire.TokenVerdict):
                raise CloudError(wire.ErrorCode.MALFORMED, f"expected a TokenVerdict, got {type(reply).__name__}")
            return chunk_verdict(reply, chunk)

        return asyncio.ensure_future(answer())


def _deep_hidden(reply: wire.Message) -> torch.Tensor:
    """A verify's answer: its deep hidden states; any other message answering it is malformed."""
    if not isinstance(reply, wire.VerifyResult):
        raise CloudError(wire.ErrorCode.MALFORMED, f"expected a VerifyResult, got {type(reply).__name__}")
    return reply.hidden.float()
