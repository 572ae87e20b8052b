"""The streamer's DiSCo stream (services/token_streamer/disco_stream.py) against device-agent doubles:
races, closing losers, paced delivery, hand-overs without lost or repeated tokens, typed errors.
The real endpoints, models and migrations are exercised in tests/e2e/test_disco_mesh.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from services.token_streamer.disco import FALLBACK_TTFT_S, History
from services.token_streamer.settings import load_settings
from shared.settings import SettingsError
from tests.mesh_tools import sse_text_and_errors
from tests.services.token_streamer.test_token_streamer import WORDS, FakeDevice, expected_text, mesh


class ModeDevice(FakeDevice):
    """A device agent double whose endpoints (modes) differ: the wait before each one's first token,
    a mode that fails after some rounds, a mode that sends garbage. Token i of the answer is id i and
    WORDS[i], and a leg given `prefix_ids` goes on from there, as a real continuation would."""

    def __init__(
        self,
        first_delay_s: dict[str, float],
        *,
        fail_mode: str | None = None,
        fail_after: int = 3,
        garbage_mode: str | None = None,
        loud_mode: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__("dev", per_round=1, **kwargs)
        self.first_delay_s = first_delay_s
        self.fail_mode, self.fail_after, self.garbage_mode = fail_mode, fail_after, garbage_mode
        self.loud_mode = loud_mode  # this endpoint's words come in capitals: who said what can be seen

    async def _lines(self, body: dict[str, Any]) -> AsyncIterator[str]:
        mode = body.get("mode")
        start = len(body.get("prefix_ids") or [])
        try:
            yield json.dumps({"type": "start", "request_id": body["request_id"], "prompt_tokens": 5 + start}) + "\n"
            await asyncio.sleep(self.first_delay_s.get(mode, 0.0))
            for n, i in enumerate(range(start, start + body["max_new_tokens"])):
                if mode == self.fail_mode and n >= self.fail_after:
                    yield json.dumps({"type": "error", "code": "CloudUnavailable", "message": "verifier gone"}) + "\n"
                    return
                ids: Any = "x" if mode == self.garbage_mode else [i]
                word = WORDS[i % len(WORDS)]
                yield (
                    json.dumps(
                        {"type": "tokens", "token_ids": ids, "text": word.upper() if mode == self.loud_mode else word}
                    )
                    + "\n"
                )
                await asyncio.sleep(self.round_delay_s)
            yield json.dumps({"type": "done", "finish_reason": "length", "stats": {"mode": mode}}) + "\n"
            self.finished += 1
        finally:
            self.active -= 1


async def complete(url: str, max_tokens: int = 8, **tophat: Any) -> httpx.Response:
    body = {"model": "m", "prompt": "hello there", "max_tokens": max_tokens, "tophat": tophat}
    async with httpx.AsyncClient(timeout=20) as http:
        return await http.post(f"{url}/v1/completions", json=body)


async def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not predicate():
        await asyncio.sleep(0.02)
    return predicate()


async def test_the_first_token_wins_the_race_and_the_loser_is_closed() -> None:
    device = ModeDevice({"cloud": 2.0, "device": 0.0}, round_delay_s=0.01)
    async with mesh(device) as url:
        response = await complete(url, dispatch="disco", budget=1.0, reading_rate_tps=0)
        assert response.status_code == 200
        body = response.json()
        stats = body["tophat"]
        assert (stats["decision"], stats["endpoint"], stats["endpoints"]) == (
            "no-history",
            "device",
            ["cloud", "device"],
        )
        assert body["choices"][0]["text"] == expected_text(8)
        assert [r["mode"] for r in device.requests] == ["cloud", "device"]
        assert await wait_for(lambda: device.active == 0)  # the cloud leg was closed, not left to run
        assert device.finished == 1
        assert stats["cost"]["tokens"]["device"]["decode"] == 8 and stats["cost"]["tokens"]["cloud"]["decode"] == 0


async def test_delivery_is_paced_at_the_reading_rate() -> None:
    device = ModeDevice({}, round_delay_s=0.0)
    async with mesh(device) as url, httpx.AsyncClient(timeout=20) as http:
        body = {
            "model": "m",
            "prompt": "hi",
            "max_tokens": 6,
            "stream": True,
            "tophat": {"dispatch": "device", "reading_rate_tps": 20},
        }
        times = []
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                    times.append(time.monotonic())
        assert len(times) == 6
        assert times[-1] - times[0] >= 5 / 20 - 0.01  # generated at once, delivered 1/r_c apart


@pytest.mark.slow
async def test_a_server_failing_mid_answer_hands_over_to_the_device_and_nothing_is_lost() -> None:
    device = ModeDevice({"device": 2.0}, fail_mode="cloud", fail_after=4, round_delay_s=0.01)
    async with mesh(device) as url:
        response = await complete(url, 12, dispatch="disco", budget=1.0, reading_rate_tps=0, migration=False)
        body = response.json()
        assert response.status_code == 200, body
        assert body["choices"][0]["text"] == expected_text(12)  # one stream: none lost, none repeated
        [migration] = body["tophat"]["migrations"]
        assert (migration["from"], migration["to"], migration["reason"], migration["at_token"]) == (
            "cloud",
            "device",
            "cloud_lost",
            4,
        )
        resumed = device.requests[-1]
        assert resumed["prefix_ids"] == [0, 1, 2, 3] and resumed["max_new_tokens"] == 8
        assert resumed["prefix_text"] == expected_text(4)


async def test_a_baseline_does_not_fail_over() -> None:
    device = ModeDevice({}, fail_mode="cloud", fail_after=2)
    async with mesh(device) as url:
        response = await complete(url, dispatch="cloud", reading_rate_tps=0)
        assert response.status_code == 502 and "verifier gone" in response.text


async def test_a_busy_second_endpoint_leaves_the_first_to_answer() -> None:
    device = ModeDevice({"cloud": 0.2}, max_sessions=1)
    async with mesh(device) as url:
        response = await complete(url, dispatch="disco", budget=1.0, reading_rate_tps=0)
        body = response.json()
        assert response.status_code == 200, body
        assert body["tophat"]["endpoint"] == "cloud" and body["choices"][0]["text"] == expected_text(8)


async def test_a_malformed_token_event_is_a_typed_error() -> None:
    device = ModeDevice({}, garbage_mode="device")
    async with mesh(device) as url:
        response = await complete(url, dispatch="device", reading_rate_tps=0)
        assert response.status_code == 502 and response.json()["error"]["code"] == "device_bad_response"


async def test_a_client_that_leaves_mid_race_closes_every_leg() -> None:
    device = ModeDevice({"cloud": 30.0, "device": 30.0})
    async with mesh(device) as url:
        task = asyncio.create_task(complete(url, dispatch="disco", budget=1.0))
        assert await wait_for(lambda: device.active == 2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await wait_for(lambda: device.active == 0)


async def test_bad_dispatch_requests_are_refused() -> None:
    async with mesh(ModeDevice({})) as url:
        both = await complete(url, dispatch="disco", mode="cloud")
        assert both.status_code == 400 and "mode" in both.text
        for bad in ({"dispatch": "fastest"}, {"budget": 1.5}, {"reading_rate_tps": -1}):
            assert (await complete(url, **bad)).status_code == 400


@pytest.mark.parametrize(
    "overrides",
    [
        {"dispatch": "fastest"},
        {"disco_budget": 2.0},
        {"disco_server_endpoint": "edge"},
        {"device_energy": "orin:1"},
        {"exchange_rate": -1.0},
        {"reading_rate_tps": -1.0},
        {"disco_migration_quantile": 1.0},
    ],
)
def test_settings_are_checked(overrides: dict[str, Any]) -> None:
    with pytest.raises((SettingsError, ValueError)):
        load_settings({}, **overrides)


@pytest.mark.slow
async def test_a_finished_endpoint_frees_its_slot_while_paced_delivery_goes_on() -> None:
    device = ModeDevice({})
    async with mesh(device) as url:
        task = asyncio.create_task(complete(url, 10, dispatch="device", reading_rate_tps=5))  # ~1.8 s to deliver
        assert await wait_for(lambda: device.finished == 1)
        async with httpx.AsyncClient(timeout=5) as http:

            async def outstanding() -> int:
                return (await http.get(f"{url}/stats")).json()["devices"][0]["outstanding"]

            for _ in range(50):  # generated at once: the streamer gives the device slot back
                if await outstanding() == 0:
                    break
                await asyncio.sleep(0.02)
            assert await outstanding() == 0
        assert not task.done()  # while the user is still reading
        assert (await task).json()["choices"][0]["text"] == expected_text(10)


async def test_tokens_generated_before_a_fatal_failure_are_delivered_first() -> None:
    # The device is the only endpoint left (a device-only baseline): when it fails, what it generated
    # still reaches the user, then the typed error.
    device = ModeDevice({}, fail_mode="device", fail_after=3)
    async with mesh(device) as url, httpx.AsyncClient(timeout=20) as http:
        body = {
            "model": "m",
            "prompt": "hi",
            "max_tokens": 8,
            "stream": True,
            "tophat": {"dispatch": "device", "reading_rate_tps": 50},
        }
        text, errors = await sse_text_and_errors(http, f"{url}/v1/completions", body)
        assert text == expected_text(3) and len(errors) == 1 and "verifier gone" in errors[0]["message"]


@pytest.mark.slow
async def test_a_seeded_random_baseline_repeats_its_choices() -> None:
    choices = []
    for _ in range(2):
        device = ModeDevice({})
        async with mesh(device, disco_seed=7) as url:
            for _ in range(6):
                assert (await complete(url, 2, dispatch="random", budget=0.5, reading_rate_tps=0)).status_code == 200
        choices.append([r["mode"] for r in device.requests])
    assert choices[0] == choices[1] and len(set(choices[0])) == 2  # the same split, and a split


def test_a_migrations_time_is_a_quantile_of_the_receivers_time_to_first_token() -> None:
    history = History(100)
    assert history.ttft_estimate_s(True, 100, 0.9) == FALLBACK_TTFT_S  # nothing seen yet
    for tokens in (10, 20, 30, 40):
        history.leg_started(True, tokens, 0.1 + 0.01 * tokens)  # exactly k*l + c
    assert history.ttft_estimate_s(True, 100, 0.9) == pytest.approx(1.1)
    for i in range(10):  # the server: no length dependence, one slow start in ten
        history.leg_started(False, 50, 2.0 if i == 0 else 0.3)
    assert history.ttft_estimate_s(False, 50, 0.5) == pytest.approx(0.3)  # mean 0.47 + the median residual
    assert history.ttft_estimate_s(False, 50, 0.95) == pytest.approx(2.0)  # the tail is covered


@pytest.mark.slow
@pytest.mark.timing  # a race of wall-clock rounds (device 20 ms, cloud 150 ms): make test runs it alone
async def test_a_hand_over_keeps_the_source_going_until_the_receiver_speaks() -> None:
    # Device-constrained (device tokens cost more): the device wins the race and, with r_c * t_m tokens
    # buffered (t_m 1 s before any receiver was seen), hands over to the cloud; the device's tokens made
    # while the cloud prefilled are dropped, the cloud's follow the hand-over point.
    device = ModeDevice({"cloud": 0.15}, loud_mode="cloud", round_delay_s=0.02)
    async with mesh(device, exchange_rate=1e-3) as url:
        response = await complete(url, 40, dispatch="disco", budget=1.0, reading_rate_tps=10)
        body = response.json()
        assert response.status_code == 200, body
        [migration] = body["tophat"]["migrations"]
        k = migration["at_token"]
        assert (migration["from"], migration["to"], "called_off" in migration) == ("device", "cloud", False)
        assert migration["buffered"] >= migration["buffer_needed"] == 10
        words = [WORDS[i % len(WORDS)] for i in range(40)]
        assert body["choices"][0]["text"] == "".join(words[:k]) + "".join(w.upper() for w in words[k:])
        assert body["tophat"]["cost"]["tokens"]["device"]["decode"] > k  # it went on while the cloud prefilled


@pytest.mark.slow
async def test_a_receiver_too_slow_for_the_buffer_is_called_off_and_nothing_stalls() -> None:
    device = ModeDevice({"cloud": 30.0}, loud_mode="cloud", round_delay_s=0.02)
    async with mesh(device, exchange_rate=1e-3) as url:
        response = await complete(url, 40, dispatch="disco", budget=1.0, reading_rate_tps=10)
        body = response.json()
        assert response.status_code == 200, body
        assert body["choices"][0]["text"] == expected_text(40)  # the device's alone: nothing lost or doubled
        migrations = body["tophat"]["migrations"]
        assert migrations and all(m["called_off"] in ("would stall", "source finished") for m in migrations)
        # no stall: the gaps stay near 1/r_c = 0.1 s (bounded loosely: a loaded machine runs timers late),
        # where waiting for this receiver would have stalled delivery for 30 s
        assert max(m.get("max_gap_s", 0.0) for m in migrations) < 5.0
    assert await wait_for(lambda: device.active == 0)  # every receiver was closed
