"""`python -m services.chunk_planner`: serve the chunk planner with uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from services.chunk_planner.app import create_app
from services.chunk_planner.settings import load_settings
from shared.processes.memory import return_freed_memory_to_os


def main() -> None:
    settings = load_settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return_freed_memory_to_os()  # fixed mmap threshold: no heap growth from freed tensors (shared/processes/memory.py)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        ssl_certfile=settings.tls_cert or None,
        ssl_keyfile=settings.tls_key or None,
    )


if __name__ == "__main__":
    main()
