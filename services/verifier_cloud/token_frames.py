"""Token mode's frames on the verifier (token_mode.py is the model's side of it).

OpenTokenSession opens a session that samples on the verifier; TokenPrefill, TokenStep and TokenDraft
queue work on one. A verifier without the full model refuses OpenTokenSession with UNKNOWN_TYPE, the
answer a verifier that predates token mode gives; token messages on a session opened with privacy on
are refused with PRIVACY_VIOLATION, and on a hidden-state session with MALFORMED.
"""

from __future__ import annotations

import logging

from websockets.asyncio.server import ServerConnection

from services.verifier_cloud.frames import work_item
from services.verifier_cloud.session import Session
from services.verifier_cloud.session_table import SessionTable
from services.verifier_cloud.token_mode import TokenModel
from services.verifier_cloud.work_item import Reply
from shared.specdec.sampling import SamplingParams
from shared.wire import schema as wire

log = logging.getLogger("services.verifier_cloud")


class TokenFrames:
    def __init__(self, sessions: SessionTable, token_model: TokenModel | None) -> None:
        """`token_model` None: token mode is off (the verifier holds only the middle layers)."""
        self.sessions = sessions
        self.token_model = token_model

    def open(self, connection: ServerConnection, message: wire.OpenTokenSession, ready: bool) -> wire.Message:
        """Open a token-mode session with the message's sampling parameters; `ready`: the verifier's readiness."""
        sid = message.session_id
        if self.token_model is None:
            raise wire.WireError(
                wire.ErrorCode.UNKNOWN_TYPE,
                "token mode is off on this verifier: it holds only the "
                "middle layers (start it with TOPHAT_VERIFIER_FULL_MODEL=true)",
                sid,
            )
        if not ready:
            raise wire.WireError(wire.ErrorCode.OVERLOADED, "verifier is not ready", sid)
        try:
            params = SamplingParams(message.temperature, message.top_p, message.seed)
        except ValueError as exc:  # the schema checks the same ranges; this keeps the two in step
            raise wire.WireError(wire.ErrorCode.MALFORMED, str(exc), sid) from None
        opened = self.sessions.open(Session(sid, connection, privacy=False, sampling=params))
        assert opened is not None  # only a fork's open answers later
        log.debug("token session %d opened (temperature %g, top_p %g)", sid, params.temperature, params.top_p)
        return opened

    def submit(
        self,
        connection: ServerConnection,
        message: wire.TokenPrefill | wire.TokenStep | wire.TokenDraft,
        reply: Reply,
    ) -> None:
        """Queue a token-mode item; refuse it on privacy sessions and on hidden-state sessions."""
        sid, seq = message.session_id, message.seq_no
        state = self.sessions.get(sid, connection, seq)
        if state.privacy:
            raise wire.WireError(
                wire.ErrorCode.PRIVACY_VIOLATION,
                f"{type(message).__name__} carries token ids; this session was opened with privacy on",
                sid,
                seq,
            )
        if not state.is_token or self.token_model is None:
            raise wire.WireError(
                wire.ErrorCode.MALFORMED, "token messages need a session opened with OpenTokenSession", sid, seq
            )
        self.token_model.check_ids(message.token_ids, sid, seq)
        self.sessions.submit(work_item(message, reply), connection)
