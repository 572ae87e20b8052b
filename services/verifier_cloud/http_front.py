"""What the verifier's one port answers over plain HTTP: /healthz, /readyz, /metrics, and the check
of a WebSocket upgrade on /ws (with a mesh secret, a device's token) before any session exists.
A connection it admits is handed to the credential watch (shared/auth/credential_watch.py), which closes it
(`close_for_credential`: code 1008, reason "credential revoked" / "credential expired") once its token is
revoked or expires: the handshake is not the last check. A device renews it on the open connection
(`reauthenticate`: a wire Reauthenticate with a fresh token, checked as the handshake checks the first).

websockets calls `process_request` for every handshake; an answer ends it there, None goes on to
the WebSocket. Readiness comes from the server (`readiness`), so this module knows no engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from http import HTTPStatus

from websockets.asyncio.server import ServerConnection
from websockets.frames import CloseCode
from websockets.http11 import Request, Response

from services.verifier_cloud.device_link import EndConnection
from services.verifier_cloud.session_table import SessionTable
from services.verifier_cloud.settings import Settings
from shared.auth import verify as auth
from shared.auth.credential_watch import CredentialWatch
from shared.telemetry.metrics import CONTENT_TYPE, METRICS_PATH, VerifierMetrics, exposition
from shared.wire import schema as wire

log = logging.getLogger("services.verifier_cloud")

WS_PATH = "/ws"
CREDENTIAL_CLOSE_CODE = CloseCode.POLICY_VIOLATION  # 1008; the reason says which: "credential revoked" / "...expired"


def credential_close_reason(reason: str) -> str:
    return f"credential {reason}"


async def close_for_credential(connection: ServerConnection, reason: str) -> None:
    """End a device's connection whose credential no longer holds (its sessions are freed as it ends)."""
    await connection.close(CREDENTIAL_CLOSE_CODE, credential_close_reason(reason))


class HttpFront:
    def __init__(
        self,
        settings: Settings,
        sessions: SessionTable,
        metrics: VerifierMetrics,
        readiness: Callable[[], tuple[bool, str]],
        trust: auth.TokenVerifier | None = None,
    ) -> None:
        """`readiness()`: (ready, the /readyz body); `trust`: checks devices' tokens (None: the mesh runs open).
        `watch` checks each admitted connection's token while it stays open; its owner (the server) runs it."""
        self.settings = settings
        self.trust = trust
        self.watch = CredentialWatch(trust, close_for_credential) if trust is not None else None
        self.sessions = sessions
        self.metrics = metrics
        self.readiness = readiness

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.path == "/healthz":
            return connection.respond(HTTPStatus.OK, "ok\n")
        if request.path == "/readyz":
            ready, body = self.readiness()
            status = HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE
            return connection.respond(status, body)
        if request.path == METRICS_PATH:
            response = connection.respond(HTTPStatus.OK, exposition(self.metrics.registry).decode())
            del response.headers["Content-Type"]  # respond() says text/plain; Prometheus wants its version too
            response.headers["Content-Type"] = CONTENT_TYPE
            return response
        if request.path != WS_PATH:
            return connection.respond(HTTPStatus.NOT_FOUND, "not found\n")
        return self.refuse_unauthenticated(connection, request)

    def refuse_unauthenticated(self, connection: ServerConnection, request: Request) -> Response | None:
        """With auth on, the upgrade needs a device's token for the verifier (shared/auth/verify.py): else 401 (none,
        forged, expired, revoked, for another audience) or 403 (a service's), before any session exists. The
        connection then lives until its token is revoked or expires (`watch`), or it ends."""
        if self.trust is None:
            return None
        try:
            claims = auth.authenticate(self.trust, request.headers.get("Authorization"), auth.VERIFIER, {"device"})
        except auth.AuthError as exc:
            log.info("refused a verifier connection from %s: %s", connection.remote_address, exc.reason)
            response = connection.respond(HTTPStatus(exc.status), f"{exc.reason}\n")
            if exc.status == HTTPStatus.UNAUTHORIZED:
                response.headers["WWW-Authenticate"] = "Bearer"
            return response
        self.sessions.device_of[connection] = claims.subject
        if self.watch is not None:
            self.watch.admit(connection, claims)
        return None

    def reauthenticate(self, connection: ServerConnection, message: wire.Reauthenticate) -> None:
        """A fresh token for an open connection, checked as the handshake checks the first (audience, role) and
        for the connection's own device: the watch then holds the connection to the new token's expiry.
        Refused (another device's token, expired, revoked, forged...): EndConnection (an ErrorFrame CREDENTIAL,
        then close 1008 "credential <reason>"). With auth off there is nothing to renew: accepted and ignored."""
        if self.trust is None or self.watch is None:
            return
        try:
            claims = auth.authenticate(self.trust, f"Bearer {message.token}", auth.VERIFIER, {"device"})
            admitted = self.sessions.device_of.get(connection)
            if claims.subject != admitted:
                raise auth.AuthError("forbidden", "a token for another device than the connection's")
        except auth.AuthError as exc:
            log.info("refused a new token from %s on its connection: %s", connection.remote_address, exc)
            refusal = wire.ErrorFrame(wire.ErrorCode.CREDENTIAL, f"token refused: {exc.reason}")
            raise EndConnection(refusal, CREDENTIAL_CLOSE_CODE, credential_close_reason(exc.reason)) from None
        if not self.watch.renew(connection, claims):
            log.info("a new token from %s came as its connection was closing; ignored", connection.remote_address)
