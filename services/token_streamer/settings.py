"""Token-streamer settings, read from `TOPHAT_STREAMER_*` environment variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.disco.cost import CostModel, parse_device_energy
from shared.modes import DISPATCHES
from shared.service_settings import ServiceSettings, reject_first
from shared.settings import from_env

ENV_PREFIX = "TOPHAT_STREAMER_"


@dataclass(frozen=True)
class Settings(ServiceSettings):
    """Defaults suit a laptop run; every field is `TOPHAT_STREAMER_<FIELD>`."""

    host: str = "127.0.0.1"
    port: int = 8000
    # Comma-separated device-agent base URLs. Empty, with state_monitor_url set: route to the agents that
    # announce themselves to the state monitor (GET /devices), re-read every discovery_interval_s.
    device_urls: str = ""
    discovery_interval_s: float = 2.0
    state_monitor_url: str = ""  # empty: no request telemetry
    model_name: str = "tophat-demo"  # the id served by /v1/models and echoed in responses
    connect_timeout_s: float = 2.0  # TCP connect to a device agent (also pool wait)
    first_byte_timeout_s: float = 30.0  # request sent -> device's first NDJSON line
    line_timeout_s: float = 30.0  # between two NDJSON lines of a running generation
    probe_timeout_s: float = 1.0  # one /readyz or /info probe
    health_interval_s: float = 5.0  # background device probe period; 0 disables it
    device_down_s: float = 5.0  # a device that failed to connect is skipped this long
    ws_idle_timeout_s: float = 600.0  # a chat WebSocket with no message this long is closed
    ws_max_pending: int = 8  # messages a chat WebSocket may send ahead of its answer; one more closes it (1008)
    ready_max_age_s: float = 1.0  # /readyz answers from a device probe round at most this old (no probe per call)
    send_timeout_s: float = 10.0  # one WebSocket send to the client
    max_new_tokens_default: int = 64  # max_tokens of a request that gives none
    max_new_tokens_limit: int = 1024  # the largest max_tokens accepted (more: 400)
    max_prompt_chars: int = 200_000  # longer prompts are rejected with 400
    # Requests beyond the devices' free sessions wait in a FCFS queue of at most queue_max_waiting
    # (more get 429 with Retry-After); one still waiting after queue_timeout_s gets 503 queue_timeout.
    queue_max_waiting: int = 256
    queue_timeout_s: float = 60.0
    telemetry_timeout_s: float = 0.5
    # The door (limits.py). api_key: comma-separated keys; with any, every route but /healthz, /readyz and
    # /metrics needs `Authorization: Bearer <key>` (empty: open). A token bucket per key (per client address
    # when open) of rate_limit_rps, rate_limit_burst deep (0 rps: no limit). A body over max_body_bytes
    # is refused (413) before it is parsed; the same bounds one chat WebSocket message.
    api_key: str = field(default="", repr=False)  # repr=False: settings are never printed with the keys
    rate_limit_rps: float = 0.0
    rate_limit_burst: int = 10
    max_body_bytes: int = 1 << 20
    # DiSCo (disco.py; shared/disco/). dispatch: "off" (one device agent, the request's own mode, as
    # before), "disco" (cost-aware: device, server or both, and token-level migration) or a baseline:
    # "device", "cloud", "hat", "random" (Stoch-S / Stoch-D). A request may override dispatch, budget and
    # reading rate in its "tophat" object.
    dispatch: str = "off"
    disco_budget: float = 0.5  # b: the share of prompt tokens the constrained endpoint may take
    disco_tail_ratio: float = 0.05  # alpha: budget reserved for the server's TTFT tail (device-constrained)
    disco_server_endpoint: str = "cloud"  # the server side: cloud (token mode, whole model) or hat
    disco_migration: bool = True  # hand decoding to the cheaper endpoint when eq. 4 says it pays
    reading_rate_tps: float = 5.0  # r_c: delivery under a dispatch policy is paced at this (0: unpaced)
    disco_history: int = 2000  # recent prompt lengths / server TTFTs the policy is built from
    disco_refresh_s: float = 5.0  # how often the history is re-read from the state monitor
    # The buffer a migration waits for is B = r_c * t_m (eq. 5) with t_m this quantile of the receiver's
    # time to first token (a median leaves every slower-than-median hand-over to stall delivery).
    disco_migration_quantile: float = 0.9
    disco_seed: int = -1  # the random baseline's generator (-1: unseeded); benches fix it
    # Unified cost (DiSCo §4.1; shared/disco/cost.py has the sources of the defaults): server $ per prompt /
    # generated token; device energy per prompt / generated token per speed class ("class:J,J;..."), the
    # exchange rate $ per J (lambda) and HAT's share of a token's compute done on the device.
    server_prompt_price: float = 0.15e-6
    server_decode_price: float = 0.60e-6
    device_energy: str = "orin:0.02,0.4;xavier:0.05,1.0;cycle:0.03,0.6"
    exchange_rate: float = 4.17e-8
    hat_device_share: float = 0.1
    # Jupiter's outline-based parallel decoding (outline.py) for requests that do not say: an outline
    # first, then its points expanded concurrently from the outline's kept KV. A request's "tophat"
    # {"outline": bool} overrides it; questions the router declines (code, math, short answers) and
    # agents without keep/fork are answered sequentially either way.
    outline: bool = False
    # The web console (console.py): its page at GET / and the JSON it polls (behind the API key); the mesh's
    # state is gathered at most once per console_refresh_s, and its plots keep console_history_s of points.
    console: bool = True
    console_refresh_s: float = 1.0
    console_history_s: float = 600.0

    def validate(self) -> None:
        super().validate()  # auth, logging, TLS (shared/service_settings.py)
        http = ("http://", "https://")
        timeouts = (
            self.connect_timeout_s,
            self.first_byte_timeout_s,
            self.line_timeout_s,
            self.probe_timeout_s,
            self.device_down_s,
            self.ws_idle_timeout_s,
            self.send_timeout_s,
            self.telemetry_timeout_s,
            self.queue_timeout_s,
            self.discovery_interval_s,
            self.console_refresh_s,
            self.console_history_s,
        )
        reject_first(
            (not 0 <= self.port <= 65535, f"port out of range: {self.port}"),
            *(
                (not url.startswith(http), f"device url must start with http:// or https://: {url!r}")
                for url in self.device_url_list
            ),
            (
                self.state_monitor_url and not self.state_monitor_url.startswith(http),
                f"state_monitor_url must be an http(s) URL: {self.state_monitor_url!r}",
            ),
            (min(timeouts) <= 0, "timeouts and device_down_s must be > 0"),
            (self.ws_max_pending < 0 or self.ready_max_age_s < 0, "ws_max_pending and ready_max_age_s must be >= 0"),
            (self.health_interval_s < 0, "health_interval_s must be >= 0 (0 disables the probe)"),
            (
                not 1 <= self.max_new_tokens_default <= self.max_new_tokens_limit,
                "need 1 <= max_new_tokens_default <= max_new_tokens_limit",
            ),
            (self.queue_max_waiting < 0, "queue_max_waiting must be >= 0 (0: no queue, a full mesh answers 429)"),
            (self.max_prompt_chars < 1, "max_prompt_chars must be >= 1"),
            (not self.model_name, "model_name must not be empty"),
            (
                self.rate_limit_rps < 0 or (self.rate_limit_rps > 0 and self.rate_limit_burst < 1),
                "rate_limit_rps must be >= 0 (0: off), and rate_limit_burst >= 1 when it is on",
            ),
            (self.max_body_bytes < 1, "max_body_bytes must be >= 1"),
            (
                self.dispatch not in DISPATCHES,
                f"dispatch must be one of {', '.join(DISPATCHES)}, got {self.dispatch!r}",
            ),
            (self.disco_server_endpoint not in ("cloud", "hat"), "disco_server_endpoint must be cloud or hat"),
            (
                not (0 <= self.disco_budget <= 1 and 0 < self.disco_tail_ratio < 1),
                "need 0 <= disco_budget <= 1 and 0 < disco_tail_ratio < 1",
            ),
            (
                self.reading_rate_tps < 0 or self.disco_history < 1 or self.disco_refresh_s <= 0,
                "need reading_rate_tps >= 0, disco_history >= 1, disco_refresh_s > 0",
            ),
            (not 0.0 < self.disco_migration_quantile < 1.0, "disco_migration_quantile must be in (0, 1)"),
        )
        self.cost_model()  # the cost settings are checked where they are defined

    def cost_model(self, speed_class: str = "orin") -> CostModel:
        """The unified cost for a device of `speed_class` (the first class listed when it has none)."""
        base = CostModel(
            server_prompt=self.server_prompt_price,
            server_decode=self.server_decode_price,
            exchange_rate=self.exchange_rate,
            hat_device_share=self.hat_device_share,
        )
        energy = parse_device_energy(self.device_energy)
        chosen = energy.get(speed_class) or next(iter(energy.values()), None)
        return base if chosen is None else base.with_device_energy(*chosen)

    @property
    def discovers_devices(self) -> bool:
        return not self.device_url_list and bool(self.state_monitor_url)

    @property
    def api_key_list(self) -> list[str]:
        """Parsed `api_key`: the comma-separated keys, stripped, empty ones dropped."""
        return [key.strip() for key in self.api_key.split(",") if key.strip()]

    @property
    def device_url_list(self) -> list[str]:
        """Parsed `device_urls`: stripped, trailing '/' removed, duplicates dropped (order kept)."""
        urls = [u.strip().rstrip("/") for u in self.device_urls.split(",") if u.strip()]
        return list(dict.fromkeys(urls))


def load_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    return from_env(Settings, ENV_PREFIX, environ, **overrides)
