"""State-monitor settings, read from `TOPHAT_STATE_MONITOR_*` environment variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.service_settings import ServiceSettings
from shared.settings import from_env

ENV_PREFIX = "TOPHAT_STATE_MONITOR_"


@dataclass(frozen=True)
class Settings(ServiceSettings):
    """Defaults suit a laptop run; every field is `TOPHAT_STATE_MONITOR_<FIELD>`."""

    host: str = "127.0.0.1"
    port: int = 8765
    # Empty: use env REDIS_URL; if that is empty too, __main__ starts an embedded
    # redis-server (embedded_redis=true) or the monitor runs in memory only.
    redis_url: str = ""
    embedded_redis: bool = True
    redis_password: str = field(default="", repr=False)  # for a redis_url without one (a secret file sets it)
    stream_maxlen: int = 10_000  # XADD MAXLEN ~ for every stream
    request_ttl_s: int = 86_400  # tophat:request:{id} hashes expire after this
    redis_timeout_s: float = 0.5  # bound on every Redis call
    redis_backoff_initial_s: float = 0.25  # first wait before reconnecting to a lost Redis, doubling
    redis_backoff_max_s: float = 5.0  # the longest wait between reconnection attempts
    alpha: float = 0.8  # HAT eq. 1-2 moving-average weight
    buckets_per_octave: int = 2  # resolution of g(mu) on the log2 scale
    device_stale_s: float = 30.0  # device state older than this is flagged stale
    max_batch: int = 1000  # records per POST /telemetry
    # bytes of one POST /telemetry, refused (413) before it is parsed: a full batch of big request records fits
    max_body_bytes: int = 16 * 2**20
    announce_ttl_s: float = 15.0  # a device agent not announced for this long leaves GET /devices
    # DiSCo: how many recent prompt lengths and server TTFTs Redis keeps (tophat:disco:* lists) for the
    # streamer's length threshold (eq. 3) and server-TTFT CDF (eq. 1); GET /disco/history serves them.
    disco_history: int = 2000
    # Edge SD: how many recent measured passes (draft, verify) and verdicts Redis keeps, each in its own
    # tophat:edge_sd:* list (POST /edge-sd/telemetry); GET /state/edge-sd serves them to the chunk planner.
    edge_sd_history: int = 512
    # The issuer (services/state_monitor/issuer.py): the directory of its Ed25519 signing keys (shared/auth/signing.py,
    # made by `tophat mesh-secrets` / `tophat serve --auth`); set, every POST needs a credential. It is only read.
    # auth_state_dir: a writable directory (a volume the monitor alone mounts) where the issuer saves what it
    # changes, before answering: rotations, revocations, which bootstrap token holds each enrolled device id
    # (issuer-state.json); empty: the key file's directory. Not writable: revoke, rotate, issue and enroll answer 503.
    # The tokens' lives: a device's credential, a service's renewed one, an audience token; max_token_ttl_s caps
    # what an operator issues and is how long a rotated-out key keeps verifying.
    auth_key_file: str = ""
    auth_state_dir: str = ""
    device_credential_ttl_s: float = 3600.0
    service_credential_ttl_s: float = 86_400.0
    access_token_ttl_s: float = 300.0
    max_token_ttl_s: float = 30 * 86_400.0

    @property
    def authenticated(self) -> bool:
        return bool(self.auth_key_file)

    def validate(self) -> None:
        super().validate()  # auth, logging, TLS (shared/service_settings.py)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        counts = ("stream_maxlen", "request_ttl_s", "max_batch", "max_body_bytes", "disco_history", "edge_sd_history")
        if min(getattr(self, name) for name in counts) < 1:
            raise ValueError(f"{', '.join(counts)} must be >= 1")
        if not 0 <= self.alpha < 1:
            raise ValueError(f"alpha must be in [0, 1): {self.alpha}")
        if self.buckets_per_octave < 1:
            raise ValueError("buckets_per_octave must be >= 1")
        if min(self.redis_timeout_s, self.redis_backoff_initial_s, self.device_stale_s, self.announce_ttl_s) <= 0:
            raise ValueError("timeouts, backoff, device_stale_s and announce_ttl_s must be > 0")
        ttls = (self.device_credential_ttl_s, self.service_credential_ttl_s, self.access_token_ttl_s)
        if min(ttls) <= 0 or max(ttls) > self.max_token_ttl_s:
            raise ValueError("token ttls must be > 0 and <= max_token_ttl_s")
        if self.redis_backoff_max_s < self.redis_backoff_initial_s:
            raise ValueError("redis_backoff_max_s must be >= redis_backoff_initial_s")


def load_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    return from_env(Settings, ENV_PREFIX, environ, **overrides)
