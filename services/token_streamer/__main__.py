"""`python -m services.token_streamer`: serve the token streamer with uvicorn.

Device agents: TOPHAT_STREAMER_DEVICE_URLS=http://127.0.0.1:8101,http://127.0.0.1:8102
Telemetry: TOPHAT_STREAMER_STATE_MONITOR_URL=http://127.0.0.1:8765 (empty: none).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI

from services.token_streamer.app import create_app
from services.token_streamer.settings import load_settings
from shared.processes.service_main import run_service

log = logging.getLogger("services.token_streamer")


def main() -> None:
    settings = load_settings()

    def build() -> FastAPI:
        log.info(
            "token streamer on %s:%d over %d device agent(s)",
            settings.host,
            settings.port,
            len(settings.device_url_list),
        )
        return create_app(settings)

    # one chat WebSocket message: the HTTP body's bound
    run_service(settings, build, ws_max_size=settings.max_body_bytes)


if __name__ == "__main__":
    main()
