"""Chunk-planner settings, read from `TOPHAT_CHUNK_PLANNER_*` environment variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared.settings import from_env

ENV_PREFIX = "TOPHAT_CHUNK_PLANNER_"


@dataclass(frozen=True)
class Settings:
    """Defaults suit a laptop run; every field is `TOPHAT_CHUNK_PLANNER_<FIELD>`."""

    host: str = "127.0.0.1"
    port: int = 8010
    default_chunk_size: int = 128   # HAT compares against server-side chunks of 128/256 (U-Sarathi)
    min_chunk_size: int = 16
    max_chunk_size: int = 1024
    # Not read yet: eq. 3 will need the state monitor's g(mu) and per-device beta_up.
    state_monitor_url: str = ""
    log_level: str = "info"

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        if self.min_chunk_size < 1:
            raise ValueError("min_chunk_size must be >= 1")
        if self.max_chunk_size < self.min_chunk_size:
            raise ValueError("max_chunk_size must be >= min_chunk_size")
        if self.default_chunk_size < 1:
            raise ValueError("default_chunk_size must be >= 1")


def load_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    return from_env(Settings, ENV_PREFIX, environ, **overrides)
