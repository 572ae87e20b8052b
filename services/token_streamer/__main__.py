"""`python -m services.token_streamer`: serve the token streamer with uvicorn.

Device agents: TOPHAT_STREAMER_DEVICE_URLS=http://127.0.0.1:8101,http://127.0.0.1:8102
Telemetry: TOPHAT_STREAMER_STATE_MONITOR_URL=http://127.0.0.1:8765 (empty: none).
"""

from __future__ import annotations

import logging

import uvicorn

from services.token_streamer.app import create_app
from services.token_streamer.settings import load_settings
from shared.processes.memory import return_freed_memory_to_os

log = logging.getLogger("services.token_streamer")


def main() -> None:
    settings = load_settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return_freed_memory_to_os()  # fixed mmap threshold: no heap growth from freed tensors (shared/processes/memory.py)
    log.info(
        "token streamer on %s:%d over %d device agent(s)", settings.host, settings.port, len(settings.device_url_list)
    )
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        ws_max_size=settings.max_body_bytes,  # one chat WebSocket message: the HTTP body's bound
        ssl_certfile=settings.tls_cert or None,
        ssl_keyfile=settings.tls_key or None,
    )


if __name__ == "__main__":
    main()
