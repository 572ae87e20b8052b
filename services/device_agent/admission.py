"""One admitted /generate request's hold on the device, given back however its client goes away.

A request is counted against `max_sessions` when it is admitted, before its response starts, so that
concurrent requests cannot all pass the check; its device session (KV allocated) is built then too. The
NDJSON stream that would give both back is an async generator, and Starlette neither starts one whose
response never began (a client gone before the first event) nor closes one it stopped reading (a client
gone at or between events). So the slot and the session are held here, released once, by whichever comes
first: the stream's own cleanup, or the response's end (`AdmittedStream`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from shared.specdec.device_session import DeviceSession


class Admission:
    """A slot of the device's `max_sessions` and, until the request's rounds take it, its device session."""

    def __init__(self, free_slot: Callable[[], None], session: DeviceSession | None):
        self._free_slot: Callable[[], None] | None = free_slot
        self._session = session

    def hand_over_session(self) -> None:
        """The rounds have the session now: their engine frees it (once no device step is using it)."""
        self._session = None

    def release(self) -> None:
        """Give the slot back, and free the session if nothing ever ran on it; later calls do nothing."""
        session, self._session = self._session, None
        if session is not None:
            session.free()
        free_slot, self._free_slot = self._free_slot, None
        if free_slot is not None:
            free_slot()


class AdmittedStream(StreamingResponse):
    """The NDJSON response of an admitted request: once the response ends, for whatever reason, its stream is
    closed (its cleanup runs where it was left) and its admission released (if the stream never ran)."""

    def __init__(self, events: AsyncGenerator[str, None], admission: Admission):
        super().__init__(events, media_type="application/x-ndjson")
        self.events = events
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.events.aclose()
            finally:
                self.admission.release()
