"""Device announcements (shared/device_registry.py) and the streamer's routable set (Router.sync)."""

from __future__ import annotations

import pytest

from services.token_streamer.router import Router
from shared.device_registry import DeviceRegistry, UrlTaken, advertised_url, auto_device_id, route_source_address


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_agent_silent_for_the_ttl_leaves_the_live_set():
    clock = Clock()
    registry = DeviceRegistry(ttl_s=10, clock=clock)
    registry.announce("a", "http://10.0.0.1:8200/")
    clock.now += 6
    registry.announce("b", "http://10.0.0.2:8200")
    assert [(e.device_id, e.url) for e in registry.live()] == [
        ("a", "http://10.0.0.1:8200"),
        ("b", "http://10.0.0.2:8200"),
    ]
    clock.now += 5  # a: 11 s silent, b: 5 s
    assert [e.device_id for e in registry.live()] == ["b"]
    registry.announce("a", "http://10.0.0.1:8200")  # back again
    assert [e.device_id for e in registry.live()] == ["a", "b"]


def test_a_new_address_replaces_the_old_entry_and_a_silent_devices_address_can_be_taken():
    clock = Clock()
    registry = DeviceRegistry(ttl_s=10, clock=clock)
    registry.announce("a", "http://10.0.0.1:8200")
    registry.announce("a", "http://10.0.0.9:8200")  # restarted elsewhere
    registry.announce("c", "http://10.0.0.5:8200")
    clock.now += 11  # c (and a) silent for the TTL
    registry.announce("a", "http://10.0.0.9:8200")
    registry.announce("d", "http://10.0.0.5:8200")  # a new agent at c's old address
    assert [(e.device_id, e.url) for e in registry.live()] == [
        ("a", "http://10.0.0.9:8200"),
        ("d", "http://10.0.0.5:8200"),
    ]


def test_a_device_cannot_claim_a_live_devices_url():
    registry = DeviceRegistry(ttl_s=10, clock=Clock())
    registry.announce("c", "http://10.0.0.5:8200")
    for url in ("http://10.0.0.5:8200", "http://10.0.0.5:8200/", "HTTP://10.0.0.5:8200/generate"):
        with pytest.raises(UrlTaken) as taken:
            registry.announce("d", url)
        assert taken.value.holder == "c"
    assert [(e.device_id, e.url) for e in registry.live()] == [("c", "http://10.0.0.5:8200")]
    assert registry.holder("http://10.0.0.5:8200/").device_id == "c" and registry.holder("http://10.0.0.6:1") is None


def test_ttl_must_be_positive():
    with pytest.raises(ValueError):
        DeviceRegistry(ttl_s=0)


def test_advertised_url():
    assert advertised_url("http://jetson-07:8200/", "0.0.0.0", 8200) == "http://jetson-07:8200"
    assert advertised_url("", "127.0.0.1", 41234) == "http://127.0.0.1:41234"
    # Bound everywhere: the address the host name resolves to (a container's own address).
    assert (
        advertised_url(
            "", "0.0.0.0", 8200, resolve=lambda name: {"c0ffee": "172.18.0.5"}[name], hostname=lambda: "c0ffee"
        )
        == "http://172.18.0.5:8200"
    )
    assert (
        advertised_url("", "::", 8200, resolve=lambda name: "fd00::5", hostname=lambda: "h") == "http://[fd00::5]:8200"
    )

    def unresolvable(name: str) -> str:
        raise OSError("no such host")

    assert advertised_url("", "0.0.0.0", 8200, resolve=unresolvable) == "http://127.0.0.1:8200"
    # With the monitor's URL: the address on the route to it (a Swarm task's overlay address, not its
    # docker_gwbridge one), falling back to the host name's when there is no route.
    assert (
        advertised_url(
            "",
            "0.0.0.0",
            8200,
            route_to="http://state-monitor:8020",
            route_source=lambda url: "10.0.1.7",
            resolve=unresolvable,
        )
        == "http://10.0.1.7:8200"
    )
    assert (
        advertised_url(
            "",
            "0.0.0.0",
            8200,
            route_to="http://state-monitor:8020",
            route_source=unresolvable,
            resolve=lambda name: "172.18.0.5",
        )
        == "http://172.18.0.5:8200"
    )


def test_route_source_address_on_loopback():
    assert route_source_address("http://127.0.0.1:8020") == "127.0.0.1"
    with pytest.raises(OSError):
        route_source_address("not a url")


def test_auto_device_id_is_a_valid_ident_per_port():
    assert auto_device_id(8200, hostname=lambda: "jetson-07") == "jetson-07-8200"
    assert auto_device_id(41234, hostname=lambda: "weird host/name") == "weird-host-name-41234"
    assert auto_device_id(1, hostname=lambda: "") == "device-1"


def test_router_sync_adds_new_devices_and_retires_missing_ones():
    router = Router(["http://a:1"])
    added, retired = router.sync(["http://a:1", "http://b:1/"])
    assert (added, retired) == (["http://b:1"], [])
    a, b = router.devices
    router.acquire(a)  # a stream is running on a
    added, retired = router.sync(["http://b:1"])
    assert (added, retired) == ([], ["http://a:1"])
    assert not router.healthy(a) and router.pick() is b
    assert [d["url"] for d in router.snapshot()] == ["http://a:1", "http://b:1"]  # a still holds a stream
    router.release(a)
    assert [d["url"] for d in router.snapshot()] == ["http://b:1"]
    added, retired = router.sync(["http://a:1", "http://b:1"])  # a announces again
    assert (added, retired) == ([], []) and router.healthy(a) and len(router.devices) == 2


def test_retired_devices_leave_the_router_once_no_request_holds_them():
    router = Router([])
    for round_ in range(100):  # agents come and go under new addresses (restarts, rescheduled pods)
        router.sync(["http://stable:1", f"http://churn-{round_}:1"])
    assert [d.url for d in router.devices] == ["http://stable:1", "http://churn-99:1"]
    assert [d.index for d in router.devices] == [0, 1]
    held = router.devices[1]
    router.acquire(held)  # a stream still runs on it when it stops being announced
    router.opened(held)
    router.sync(["http://stable:1", "http://new:1"])
    assert [d.url for d in router.devices] == ["http://stable:1", "http://churn-99:1", "http://new:1"]
    router.release(held)
    router.sync(["http://stable:1", "http://new:1"])
    assert [d.url for d in router.devices] == ["http://stable:1", "http://new:1"]
    assert sorted(router.pick().url for _ in range(4)) == ["http://new:1"] * 2 + ["http://stable:1"] * 2
    router.sync([])
    assert router.devices == [] and router.pick() is None
