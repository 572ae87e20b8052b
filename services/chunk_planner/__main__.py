"""`python -m services.chunk_planner`: serve the chunk planner with uvicorn."""

from __future__ import annotations

from services.chunk_planner.app import create_app
from services.chunk_planner.settings import load_settings
from shared.processes.service_main import run_service


def main() -> None:
    settings = load_settings()
    run_service(settings, lambda: create_app(settings))


if __name__ == "__main__":
    main()
