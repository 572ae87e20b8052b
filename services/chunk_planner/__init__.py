"""Chunk planner (HAT §3.3): prefill chunk sizes for devices' prompt uploads.

Run with `python -m services.chunk_planner`; build the ASGI app with `create_app(settings)`.
"""

from services.chunk_planner.app import ChunkPlan, create_app, plan_chunk_size
from services.chunk_planner.settings import ENV_PREFIX, Settings, load_settings

__all__ = ["ENV_PREFIX", "ChunkPlan", "Settings", "create_app", "load_settings", "plan_chunk_size"]
