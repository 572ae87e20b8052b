"""How a call to the verifier fails: it refused (CloudError), could not be reached (CloudUnavailable), or was
reached but did not answer in time (CloudTimeout); and which of these a failover replay (or, past it, the
device finishing alone) answers."""

from __future__ import annotations

from shared.specdec.replay import FailoverExhausted
from shared.wire import schema as wire


class CloudError(RuntimeError):
    """The verifier answered with an ErrorFrame."""

    def __init__(self, code: wire.ErrorCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code, self.detail = code, message


class CloudUnavailable(ConnectionError):
    """The verifier could not be reached or the connection dropped."""


class CloudTimeout(CloudUnavailable):
    """The connection is up (its pings are answered) but the verifier did not take or answer a request in time."""


def verifier_lost(exc: BaseException) -> bool:
    """Whether a failed request means the session's verifier state is gone (so a replay can rebuild it): the
    connection dropped or no verifier can be reached, or the verifier no longer knows the session. A timeout is
    not a loss: the verifier is overloaded and still holds the session (a verifier that died or vanished closes
    the connection, or fails its pings within 40 s), and replaying the whole context to it would add to its load;
    the request fails with CloudTimeout instead."""
    if isinstance(exc, CloudTimeout):
        return False
    if isinstance(exc, CloudUnavailable):
        return True
    return isinstance(exc, CloudError) and exc.code == wire.ErrorCode.UNKNOWN_SESSION


def cloud_gone(exc: BaseException) -> bool:
    """Whether the cloud cannot serve the session any more (on_cloud_loss finish_on_device then lets the draft
    model finish alone): its verifier was lost, did not answer in time, or the failover replay gave up."""
    return isinstance(exc, (CloudTimeout, FailoverExhausted)) or verifier_lost(exc)
