"""`python -m services.device_agent`: one device's agent."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import uvicorn

from services.device_agent.app import create_app
from services.device_agent.settings import Settings, load_settings

log = logging.getLogger("services.device_agent")


def missing_adapter(settings: Settings) -> str | None:
    """Why a speculative agent cannot start for want of a draft adapter (None: it can). Said before the
    model loads, as one line, instead of a traceback from the app's startup."""
    from shared.model.adapter import ADAPTER_FILENAME

    if not settings.speculative or settings.adapter:
        return None  # no adapter needed, or an explicit one ('random' or a file the loader checks)
    path = Path(settings.model_dir) / ADAPTER_FILENAME
    if path.is_file():
        return None
    return (f"no draft adapter at {path}: set TOPHAT_DEVICE_ADAPTER=random (untrained: lossless, accepts "
            "little) or to an adapter file, or TOPHAT_DEVICE_SPECULATIVE=false (plain U-shape)")


def main() -> None:
    settings = load_settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = missing_adapter(settings)
    if problem:
        log.error("%s", problem)
        sys.exit(2)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level.lower())


if __name__ == "__main__":
    main()
