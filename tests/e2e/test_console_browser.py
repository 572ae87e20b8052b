"""The web console in a real browser (issue 50): headless Chromium, driven over the DevTools Protocol, opens the
console of a real local mesh (demo model, two device agents, an API key), enters the key, sends a chat message
and sees the API's own greedy text, sees every device of the mesh and the plots update.

`make test-browser` runs it (it installs Debian's chromium first where it can); without a Chromium it skips.
TOPHAT_CONSOLE_SCREENSHOT=<path> saves the console as a PNG there (docs/images/console.png)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from tests.browser_tools import Browser, find_chromium
from tests.conftest import DEMO_MODEL_DIR
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig
from tophatctl.mesh_ports import find_port_base

pytestmark = [pytest.mark.slow, pytest.mark.browser]

KEY = "console-test-key"
MAX_TOKENS = 24
PROMPTS = ["def fibonacci(n):", "class Stack:"]
MAX_ASSET_BYTES = 300_000  # "a few hundred KB"
MAX_LOAD_MS = 1000.0


@pytest.fixture(scope="module")
def chromium():
    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium on PATH (make test-browser installs Debian's)")
    return binary


@pytest.fixture(scope="module")
def mesh(chromium):
    config = MeshConfig(model_dir=str(DEMO_MODEL_DIR), num_devices=2, port_base=find_port_base(2), api_key=KEY)
    with Mesh(config) as running:
        yield running


def api_answer(url: str, messages: list[dict[str, str]]) -> str:
    """The same chat as the page sends (the conversation so far), through the API, not streamed."""
    body = {"model": "tophat", "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}
    response = httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {KEY}"},
        trust_env=False,
    )
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def points(page, plot: str) -> int:
    return int(page.eval(f"document.getElementById('{plot}').dataset.points || '0'"))


def test_the_console_in_a_browser(mesh, chromium, tmp_path):
    url = mesh.config.streamer_url
    expected = {
        device["device_id"]
        for device in httpx.get(
            f"{url}/console/mesh", headers={"Authorization": f"Bearer {KEY}"}, trust_env=False
        ).json()["devices"]
    }
    assert len(expected) == 2 and None not in expected
    with Browser(chromium) as page:
        page.open(f"{url}/")
        # the page loads fast and small; it holds no data until the key is given
        timing = page.eval("""(() => { const n = performance.getEntriesByType('navigation')[0];
            const r = performance.getEntriesByType('resource').filter((e) => e.name.includes('/console/static/'));
            return {load_ms: n.loadEventEnd - n.startTime,
                    bytes: n.decodedBodySize + r.reduce((s, e) => s + e.decodedBodySize, 0), assets: r.length}; })()""")
        print(f"console page: {timing}")
        assert timing["assets"] == 3 and 0 < timing["bytes"] < MAX_ASSET_BYTES
        assert timing["load_ms"] < MAX_LOAD_MS
        page.wait_for("document.getElementById('key-dialog').open")
        assert page.eval("document.querySelectorAll('#devices tbody tr').length") == 0

        page.type_into("#key-input", KEY)
        page.click("#key-submit")
        page.wait_for("document.querySelectorAll('#devices tbody tr[data-device]').length === 2")
        shown = set(page.eval("[...document.querySelectorAll('#devices tbody tr')].map((r) => r.dataset.device)"))
        assert shown == expected
        assert page.eval("sessionStorage.getItem('tophat-api-key')") == KEY
        page.wait_for("document.querySelectorAll('#devices td.yes').length === 2")  # both ready

        before = points(page, "plot-ttft")
        page.eval(f"document.getElementById('opt-max-tokens').value = '{MAX_TOKENS}'")
        conversation: list[dict[str, str]] = []  # the page keeps the turns: each message goes with those before
        for n, prompt in enumerate(PROMPTS, start=1):
            page.type_into("#chat-input", prompt)
            page.click("#chat-send")
            page.wait_for(f"document.querySelectorAll('.msg.assistant[data-state=done]').length === {n}", 60)
            text = page.eval("[...document.querySelectorAll('.msg.assistant .text')].at(-1).textContent")
            conversation.append({"role": "user", "content": prompt})
            assert text == api_answer(url, conversation)
            conversation.append({"role": "assistant", "content": text})
            stats = page.eval("[...document.querySelectorAll('.msg.assistant .stats')].at(-1).textContent")
            assert "TTFT" in stats and "TBT" in stats and "accept" in stats and "mode hat" in stats, stats
        # the plots take the new requests (the page's two and the API's two) within a refresh or two
        page.wait_for(f"Number(document.getElementById('plot-ttft').dataset.points) >= {before + 2 * len(PROMPTS)}", 10)
        assert points(page, "plot-tbt") >= 2 * len(PROMPTS) and points(page, "plot-accept") >= 2 * len(PROMPTS)
        load = points(page, "plot-load")
        page.wait_for(f"Number(document.getElementById('plot-load').dataset.points) > {load}", 10)  # live
        page.wait_for("document.querySelectorAll('#verifiers tbody tr[data-verifier]').length === 1")
        assert page.eval("document.querySelector('#verifiers tbody tr td:nth-child(2)').textContent") == "cpu"
        page.eval("document.getElementById('messages').scrollTop = 0")
        shot = Path(os.environ.get("TOPHAT_CONSOLE_SCREENSHOT") or tmp_path / "console.png")
        page.screenshot(shot)
        assert shot.stat().st_size > 10_000


def test_nothing_with_data_is_reachable_without_the_key(mesh):
    url = mesh.config.streamer_url
    for path in ("/console/mesh", "/console/history", "/stats", "/v1/models"):
        assert httpx.get(f"{url}{path}", trust_env=False).status_code == 401, path
    page = httpx.get(f"{url}/", trust_env=False)
    assert page.status_code == 200 and "device-0" not in page.text  # the shell only: no device, no data
    sizes = [
        len(httpx.get(f"{url}/console/static/{name}", trust_env=False).content)
        for name in ("console.js", "plot.js", "console.css")
    ]
    assert sum(sizes) + len(page.content) < MAX_ASSET_BYTES
    history = httpx.get(f"{url}/console/history", headers={"Authorization": f"Bearer {KEY}"}, trust_env=False)
    assert json.loads(history.text)["window_s"] > 0
