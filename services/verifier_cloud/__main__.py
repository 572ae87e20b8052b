"""`python -m services.verifier_cloud`: serve the middle submodel over WebSocket."""

from __future__ import annotations

import asyncio
import logging
import signal

import torch

from services.verifier_cloud.server import VerifierServer
from services.verifier_cloud.settings import load_settings


async def _main() -> None:
    settings = load_settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(settings.torch_threads)
    server = VerifierServer.from_settings(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.serve_forever(stop)


def main() -> None:
    asyncio.run(_main())


if __name__ == "__main__":
    main()
