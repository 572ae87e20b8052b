"""How a call to the verifier fails: it refused (CloudError) or could not be reached (CloudUnavailable)."""

from __future__ import annotations

from shared import wire


class CloudError(RuntimeError):
    """The verifier answered with an ErrorFrame."""

    def __init__(self, code: wire.ErrorCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code, self.detail = code, message


class CloudUnavailable(ConnectionError):
    """The verifier could not be reached or the connection dropped."""


def verifier_lost(exc: BaseException) -> bool:
    """Whether a failed request means the session's verifier state is gone (so a replay can rebuild it):
    the connection dropped or timed out, or the verifier no longer knows the session."""
    if isinstance(exc, CloudUnavailable):
        return True
    return isinstance(exc, CloudError) and exc.code == wire.ErrorCode.UNKNOWN_SESSION
