"""One request's generation as the user sees it: stop strings, TTFT/TBT from arrival, stats, telemetry.

The stream under a `Run` is a plain `DeviceStream`, a `DiscoStream` (two endpoints,
maybe a migration) or an `OutlineStream` (points answered in parallel); they all
yield the same NDJSON events, so the user-facing side here does not care which.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from services.token_streamer import openai_format as of
from services.token_streamer.device_stream import DeviceStream
from services.token_streamer.disco_stream import DiscoStream
from services.token_streamer.outline import OutlineStream
from services.token_streamer.router import DeviceError, DeviceState
from shared.console.history import ConsoleHistory
from shared.telemetry import latency_stats
from shared.telemetry.client import TelemetryClient
from shared.telemetry.latency_stats import Timeline
from shared.telemetry.metrics import StreamerMetrics


class Run:
    """One request's generation on one device: stop strings, user-side timing, stats, telemetry."""

    def __init__(
        self,
        stream: DeviceStream | DiscoStream | OutlineStream,
        stops: list[str],
        started: float,
        request_id: str,
        telemetry: TelemetryClient,
        metrics: StreamerMetrics | None = None,
        history: ConsoleHistory | None = None,
    ) -> None:
        self.stream = stream
        self.scanner = of.StopScanner(stops)
        self.started = started
        self.request_id = request_id
        self.telemetry = telemetry
        self.metrics = metrics
        self.history = history  # the web console's plots (console.py)
        self.finish_reason = "length"
        self.timeline = Timeline(started)  # one delivery per NDJSON 'tokens' line, perf_counter times
        self.device_stats: dict[str, Any] | None = None
        self.extra: dict[str, Any] = {}  # more of what happened, for the final stats (e.g. "outline")
        self._closed = False

    @property
    def device(self) -> DeviceState:
        """The device the request runs on (a DiscoStream has one once started, before its Run exists)."""
        device = self.stream.device
        assert device is not None, "a Run is made only from a started stream"
        return device

    async def deltas(self) -> AsyncIterator[str]:
        """Non-empty text deltas for the user; DeviceError if the device fails mid-way."""
        async for event in self.stream.events():
            kind = event.get("type")
            if kind == "tokens":
                ids = event.get("token_ids")
                self._observe(len(ids) if isinstance(ids, list) else 0)
                text = self.scanner.feed(str(event.get("text") or ""))
                if text:
                    yield text
                if self.scanner.stopped:
                    self.finish_reason = "stop"
                    return
            elif kind == "done":
                self.finish_reason = "stop" if event.get("finish_reason") == "stop" else "length"
                stats = event.get("stats")
                self.device_stats = stats if isinstance(stats, dict) else None
                tail = self.scanner.flush()
                if tail:
                    yield tail
                return
            elif kind == "error":
                raise DeviceError(
                    502,
                    str(event.get("code") or "device_error"),
                    str(event.get("message") or "the device failed mid-generation"),
                )
        tail = self.scanner.flush()  # events() ends only after done/error or by raising
        if tail:
            yield tail

    def _observe(self, n: int) -> None:
        """Timing on arrival, from request arrival here (TTFT/TBT as shared/telemetry/latency_stats.py defines them)."""
        self.timeline.deliver(time.perf_counter(), n)

    @property
    def ttft_s(self) -> float | None:
        return latency_stats.ttft_s(self.timeline)

    @property
    def token_times_s(self) -> list[float]:
        """TBT samples, one per token after the first (the telemetry record's `token_times_s`)."""
        return latency_stats.tbt_samples_s(self.timeline)

    @property
    def rounds(self) -> list[int]:
        """Tokens per delivery: the prefill's, then each round's."""
        return self.timeline.tokens

    @property
    def completion_tokens(self) -> int:
        return self.timeline.num_tokens

    @property
    def accept_lengths(self) -> list[int]:
        """Tokens per verification round; the first line is the prefill's token when it has one."""
        rounds = self.rounds
        num_rounds = (self.device_stats or {}).get("num_rounds")
        if rounds and (num_rounds == len(rounds) - 1 or (num_rounds is None and rounds[0] == 1)):
            return rounds[1:]
        return list(rounds)

    @property
    def mean_accept_length(self) -> float | None:
        stats = self.device_stats or {}
        return stats.get("mean_accept_length", latency_stats.mean_accept_length(self.accept_lengths))

    def tophat(self) -> dict[str, Any]:
        stats = self.device_stats or {}
        accepts = self.accept_lengths
        mean_accept = self.mean_accept_length
        disco = self.stream.summary() if isinstance(self.stream, DiscoStream) else {}
        return {
            **disco,
            "device_id": self.device.device_id,
            "queue_wait_s": self.stream.queue_wait_s,
            "ttft_s": self.ttft_s,
            "tbt_s": latency_stats.mean_tbt_s(self.timeline),
            "mean_accept_length": mean_accept,
            "num_rounds": stats.get("num_rounds", len(accepts)),
            "prompt_tokens": self.stream.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "rounds": list(self.rounds),  # tokens per delivery: the prefill's, then each round's
            "device_stats": self.device_stats,
            **self.extra,
        }

    def usage(self) -> dict[str, int]:
        return of.usage(self.stream.prompt_tokens, self.completion_tokens)

    async def close(self) -> None:
        """Release the device (stops its generation if still running) and report telemetry once."""
        if self._closed:
            return
        self._closed = True
        await self.stream.aclose()
        if self.metrics is not None:  # TTFT, ITL and e2e as the user saw them, from arrival here
            self.metrics.request_done(self.ttft_s, self.token_times_s, time.perf_counter() - self.started)
        if self.history is not None:
            mode = (self.device_stats or {}).get("mode")
            self.history.request_done(
                time.time(),
                self.device.device_id,
                self.ttft_s,
                latency_stats.mean_tbt_s(self.timeline),
                self.mean_accept_length,
                mode if isinstance(mode, str) else None,
            )
        disco = self.stream.summary() if isinstance(self.stream, DiscoStream) else None
        self.telemetry.emit_request(
            self.request_id,
            device_id=self.device.device_id,
            ttft_s=self.ttft_s,
            token_times_s=self.token_times_s,
            accept_lengths=self.accept_lengths,
            prompt_tokens=self.stream.prompt_tokens,
            **(
                {}
                if disco is None
                else {
                    "endpoint": disco["endpoint"],
                    "server_ttft_s": disco["server_ttft_s"],
                    "cost": disco["cost"]["total"],
                    "dispatch": disco["dispatch"],
                }
            ),
        )
