"""Outline-based parallel decoding in the streamer (services/token_streamer/outline.py).

Against a *fake* device agent (`OutlineAgent`, real uvicorn, real HTTP) that speaks the keep/fork
API: it holds kept sequences as text, answers the question with a fixed outline and each point
with a fixed answer, so the flow's order, concurrency, fallbacks, errors and handle clean-up can be
checked exactly (the demo model writes no outlines). The last test runs the flow on the real device
agent (real uvicorn, a real verifier, the demo model): the KV is forked, the handles are made and
freed, and each point's text is the plain request's on the same token sequence (greedy)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.token_streamer import outline as outline_flow
from services.token_streamer.dispatcher import Dispatcher
from shared.chat import plain_chat_text
from shared.jupiter.outline import OUTLINE_DIRECTIVE, OUTLINE_OPENING, PLAIN_FORMAT, heading
from tests.conftest import DEMO_MODEL_DIR
from tests.mesh_tools import sse_text_and_errors, verifier_on_loopback
from tests.services.token_streamer.test_token_streamer import mesh, serve

QUESTION = "What are good ways to improve my sleep quality?"
OUTLINE = " Keep a schedule\n2. Dim the lights\n3. Skip late coffee\n"  # continues the opening "1."
_POINT = re.compile(r"for point (\d+) of your outline")


def answer_words(index: int) -> list[str]:
    return [f"Answer{index}", " is", " here", "."]


class OutlineAgent:
    """Device-agent double with keep/fork/DELETE. `gates[i]`: point i waits for it before answering;
    `fail_point`: that point sends an error mid-answer; `outline`: what the question is answered with."""

    def __init__(
        self, *, outline: str = OUTLINE, chat_format: bool = True, keeps: bool = True, fail_point: int | None = None
    ) -> None:
        self.outline = outline
        self.chat_format = chat_format
        self.keeps = keeps
        self.fail_point = fail_point
        self.gates: dict[int, asyncio.Event] = {}
        self.kept: dict[str, str] = {}  # handle -> the kept sequence's text
        self.requests: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self.active = 0
        self.peak_points = 0  # most point expansions running at once
        self._points_running = 0
        self._next = 0

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            body = await request.json()
            self.requests.append(body)
            prefix = ""
            if body.get("fork") is not None:
                if body["fork"] not in self.kept:
                    return JSONResponse(
                        {
                            "error": {
                                "type": "unknown_kept_session",
                                "code": "unknown_kept_session",
                                "message": "no such kept session",
                            }
                        },
                        status_code=404,
                    )
                prefix = self.kept[body["fork"]]
            self.active += 1
            prompt = body["prompt"] if "prompt" in body else plain_chat_text(body["messages"])
            return StreamingResponse(self._lines(body, prefix + prompt), media_type="application/x-ndjson")

        @app.delete("/kept/{handle}")
        async def delete(handle: str) -> Any:
            self.deleted.append(handle)
            return JSONResponse({}, status_code=200 if self.kept.pop(handle, None) is not None else 404)

        @app.get("/info")
        async def info() -> dict[str, Any]:
            extra = {"chat_format": PLAIN_FORMAT.to_dict()} if self.chat_format else {}
            return {"device_id": "fake", "max_sessions": 8, **extra}

        @app.get("/readyz")
        async def readyz() -> dict[str, bool]:
            return {"ready": True}

        return app

    def _words(self, sequence: str) -> tuple[list[str], int | None]:
        if sequence.endswith(QUESTION + "\nassistant:" + OUTLINE_OPENING):  # the outline request
            return re.findall(r"\S+\s*", self.outline), None
        if not sequence.endswith("assistant:"):
            return [], None
        point = _POINT.findall(sequence)
        if point:
            return answer_words(int(point[-1])), int(point[-1])
        if "user: " in sequence:  # a sequential answer: the fake writes the outline text as its answer
            return re.findall(r"\S+\s*", self.outline), None
        return [], None

    async def _lines(self, body: dict[str, Any], sequence: str) -> AsyncIterator[str]:
        words, point = self._words(sequence)
        words = words[: body["max_new_tokens"]]
        if point is not None:
            self._points_running += 1
            self.peak_points = max(self.peak_points, self._points_running)
        try:
            yield json.dumps({"type": "start", "request_id": body.get("request_id"), "prompt_tokens": 10}) + "\n"
            if point in self.gates:
                await self.gates[point].wait()
            for k, word in enumerate(words):
                if point is not None and point == self.fail_point and k == 2:
                    yield json.dumps({"type": "error", "code": "CloudUnavailable", "message": "verifier gone"}) + "\n"
                    return
                yield json.dumps({"type": "tokens", "token_ids": [k], "text": word}) + "\n"
                await asyncio.sleep(0)
            done: dict[str, Any] = {
                "type": "done",
                "finish_reason": "length",
                "stats": {"completion_tokens": len(words)},
            }
            if body.get("keep") and self.keeps:
                self._next += 1
                handle = f"h{self._next}"
                self.kept[handle] = sequence + "".join(words)
                done["kept"] = {"handle": handle, "length": len(self.kept[handle])}
            yield json.dumps(done) + "\n"
        finally:
            self.active -= 1
            if point is not None:
                self._points_running -= 1


def expected_answer(points: int = 3, words: int | None = None) -> str:
    titles = ["Keep a schedule", "Dim the lights", "Skip late coffee"]
    parts = [
        ("" if i == 1 else "\n\n") + f"{i}. {titles[i - 1]}\n" + "".join(answer_words(i)[:words])
        for i in range(1, points + 1)
    ]
    return "".join(parts)


async def ask(url: str, question: str = QUESTION, max_tokens: int = 12, **tophat: Any) -> httpx.Response:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "tophat": {"outline": True, **tophat},
    }
    async with httpx.AsyncClient(timeout=20) as http:
        return await http.post(f"{url}/v1/chat/completions", json=body)


async def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)
    return True


async def test_points_are_forked_from_the_outline_run_at_once_and_joined_in_order() -> None:
    agent = OutlineAgent()
    async with mesh(agent) as url:
        response = await ask(url)
        body = response.json()
        assert response.status_code == 200, body
        assert body["choices"][0]["message"]["content"] == expected_answer()
        assert body["tophat"]["outline"]["used"] is True and body["tophat"]["outline"]["points"] == 3
        directive, outline, *points = agent.requests
        assert directive["prompt"] == PLAIN_FORMAT.directive_text() and OUTLINE_DIRECTIVE in directive["prompt"]
        assert (directive["max_new_tokens"], directive["keep"], directive.get("fork")) == (0, True, None)
        assert outline["fork"] == "h1" and outline["keep"] is True
        assert outline["prompt"] == PLAIN_FORMAT.question_text(QUESTION) + OUTLINE_OPENING
        assert [p["fork"] for p in points] == ["h2"] * 3 and not any(p.get("keep") for p in points)
        assert all(p["max_new_tokens"] == 12 // 3 for p in points)  # the request's budget, shared
        assert agent.peak_points == 3  # concurrently, not one after the other
        await wait_for(lambda: agent.active == 0 and "h2" in agent.deleted)
        assert list(agent.kept) == ["h1"]  # the outline freed, the directive cached

        again = await ask(url)  # the directive is prefilled once per device
        assert again.json()["choices"][0]["message"]["content"] == expected_answer()
        assert [r.get("fork") for r in agent.requests[5:]] == ["h1", "h3", "h3", "h3"]


async def test_later_points_are_buffered_while_the_first_streams_live() -> None:
    agent = OutlineAgent()
    agent.gates = {2: asyncio.Event(), 3: asyncio.Event()}
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 12,
        "stream": True,
        "temperature": 0,
        "tophat": {"outline": True},
    }
    seen = ""
    async with mesh(agent) as url, httpx.AsyncClient(timeout=20) as http:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                seen += chunk["choices"][0]["delta"].get("content") or "" if chunk.get("choices") else ""
                if seen.endswith("Answer1 is here."):  # point 1 whole while points 2 and 3 are held
                    agent.gates[3].set()  # point 3 finishes first, and still comes after point 2
                    await wait_for(lambda: agent._points_running == 1)
                    agent.gates[2].set()
    assert seen == expected_answer()


async def test_the_router_declines_code_and_math_and_answers_sequentially() -> None:
    agent = OutlineAgent()
    async with mesh(agent) as url:
        for question, reason in [
            ("Write a Python function that reverses a linked list", "code"),
            ("Solve 3x + 5 = 20 for x", "math"),
        ]:
            response = await ask(url, question)
            assert response.json()["tophat"]["outline"] == {"used": False, "reason": reason, "points": 0}
        assert all("keep" not in r and "fork" not in r for r in agent.requests)
        assert [r["messages"][0]["content"] for r in agent.requests][0].startswith("Write a Python")


async def test_an_outline_of_one_point_falls_back_and_frees_its_handle() -> None:
    agent = OutlineAgent(outline="Sleep more.")
    async with mesh(agent) as url:
        body = (await ask(url)).json()
        assert body["tophat"]["outline"] == {"used": False, "reason": "outline_points<2", "points": 0}
        assert agent.requests[-1]["messages"] == [{"role": "user", "content": QUESTION}]  # sequential
        assert agent.deleted == ["h2"] and list(agent.kept) == ["h1"]


@pytest.mark.parametrize("lacks", ["chat_format", "keep"])
async def test_an_agent_without_keep_fork_is_answered_sequentially(lacks: str) -> None:
    agent = OutlineAgent(chat_format=lacks != "chat_format", keeps=lacks != "keep")
    async with mesh(agent) as url:
        body = (await ask(url)).json()
        reason = "device_lacks_chat_format" if lacks == "chat_format" else "device_lacks_fork"
        assert body["tophat"]["outline"] == {"used": False, "reason": reason, "points": 0}
        assert "messages" in agent.requests[-1]
        asked = len(agent.requests)
        await ask(url)  # remembered: no second attempt right away
        assert len(agent.requests) == asked + 1


async def test_a_failed_point_is_a_typed_error_after_what_was_delivered() -> None:
    agent = OutlineAgent(fail_point=2)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 12,
        "stream": True,
        "temperature": 0,
        "tophat": {"outline": True},
    }
    async with mesh(agent) as url, httpx.AsyncClient(timeout=20) as http:
        text, errors = await sse_text_and_errors(http, f"{url}/v1/chat/completions", body)
        await wait_for(lambda: agent.active == 0 and "h2" in agent.deleted)
    assert text == expected_answer(1) + "\n\n2. Dim the lights\nAnswer2 is"
    [error] = errors
    assert error["code"] == "CloudUnavailable" and "outline point 2" in error["message"]


async def test_a_forgotten_directive_is_prefilled_again_once() -> None:
    agent = OutlineAgent()
    async with mesh(agent) as url:
        assert (await ask(url)).status_code == 200
        agent.kept.clear()  # the agent restarted: every handle is gone
        body = (await ask(url)).json()
        assert body["choices"][0]["message"]["content"] == expected_answer()
        forks = [r.get("fork") for r in agent.requests[5:]]
        assert forks == ["h1", None, "h3", "h4", "h4", "h4"]  # refused, prefilled anew, then the outline


async def test_the_setting_turns_it_on_and_a_request_turns_it_off() -> None:
    agent = OutlineAgent()
    async with mesh(agent, outline=True) as url:
        body = {"model": "m", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12}
        async with httpx.AsyncClient(timeout=20) as http:
            on = (await http.post(f"{url}/v1/chat/completions", json=body)).json()
            off = (await http.post(f"{url}/v1/chat/completions", json={**body, "tophat": {"outline": False}})).json()
        assert on["tophat"]["outline"]["used"] is True
        assert "outline" not in off["tophat"] and "fork" not in agent.requests[-1]


# -- the real device agent ---------------------------------------------------------------------------


async def plain_generate(http: httpx.AsyncClient, url: str, prompt_ids: list[int], max_new_tokens: int) -> dict:
    """The tokens, text and finish of one plain (not forked) greedy request."""
    response = await http.post(
        f"{url}/generate",
        json={"prompt_ids": prompt_ids, "max_new_tokens": max_new_tokens, "temperature": 0.0, "mode": "hat"},
    )
    events = [json.loads(line) for line in response.text.splitlines()]
    assert events[-1]["type"] == "done", events[-1]
    tokens = [e for e in events if e["type"] == "tokens"]
    return {
        "ids": [t for e in tokens for t in e["token_ids"]],
        "text": "".join(e["text"] for e in tokens),
        "finish": events[-1]["finish_reason"],
    }


@pytest.mark.slow
async def test_on_the_real_agent_points_fork_the_outline_kv_and_equal_plain_requests(
    demo_checkpoint, monkeypatch
) -> None:
    from services.device_agent.app import create_app as device_app
    from services.device_agent.settings import Settings as DeviceSettings

    # The demo model's outline is gibberish: the flow takes two fixed points from whatever it wrote.
    monkeypatch.setattr(outline_flow, "parse_outline", lambda text: ["alpha", "beta"])
    opened: list[dict[str, Any]] = []
    open_beside = Dispatcher.open_beside

    async def recording_open_beside(self, device, body):
        opened.append(body)
        return await open_beside(self, device, body)

    monkeypatch.setattr(Dispatcher, "open_beside", recording_open_beside)
    encode = lambda text: demo_checkpoint.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    async with verifier_on_loopback(demo_checkpoint) as (_server, ws_url):
        settings = DeviceSettings(
            model_dir=str(DEMO_MODEL_DIR),
            split_layers=2,
            adapter="",
            verifier_url=ws_url,
            wire_dtype="f4",
            prompt_chunking=False,
            port=0,
        )
        async with (
            serve(device_app(settings)) as device_url,
            mesh(device_url) as url,
            httpx.AsyncClient(timeout=60) as http,
        ):
            info = (await http.get(f"{device_url}/info")).json()
            assert info["chat_format"] == PLAIN_FORMAT.to_dict()  # the demo tokenizer has no template
            response = await ask(url, max_tokens=16)
            body = response.json()
            assert response.status_code == 200, body
            assert body["tophat"]["outline"]["used"] is True and body["tophat"]["outline"]["points"] == 2

            directive, outline, *points = opened
            assert (directive["max_new_tokens"], directive["keep"]) == (0, True)
            assert outline["keep"] is True and outline["fork"] and outline["fork"] != points[0]["fork"]
            assert [p["fork"] for p in points] == [points[0]["fork"]] * 2  # both from the outline's KV
            # The outline's handle is freed, the directive's kept for the next request.
            assert (await http.get(f"{device_url}/info")).json()["kept_sessions"] == 1
            assert (await http.delete(f"{device_url}/kept/{points[0]['fork']}")).status_code == 404

            # Each point's text is the plain request on directive + question + outline + point turn.
            context = encode(PLAIN_FORMAT.directive_text()) + encode(
                PLAIN_FORMAT.question_text(QUESTION) + OUTLINE_OPENING
            )
            sketch = await plain_generate(http, device_url, context, outline_flow.OUTLINE_MAX_TOKENS)
            expected = ""
            for index, point in enumerate(["alpha", "beta"], 1):
                turn = PLAIN_FORMAT.point_text(index, point, outline_ended_turn=sketch["finish"] == "stop")
                assert points[index - 1]["prompt"] == turn
                plain = await plain_generate(http, device_url, context + sketch["ids"] + encode(turn), 8)
                expected += heading(index, point) + plain["text"].lstrip()
            assert body["choices"][0]["message"]["content"] == expected


async def test_a_cancelled_close_still_gives_the_device_slot_back() -> None:
    """The stream holds a queue slot: a close cancelled while it deletes the outline's handle must still
    release it (a leaked slot leaves the device short of one for good)."""

    class StuckFlow:
        wait_timeout_s = 5.0
        dispatcher = None

        def __init__(self) -> None:
            self.released: list[object] = []
            self.deleting = asyncio.Event()

        async def delete_handle(self, device: object, handle: str) -> None:
            self.deleting.set()
            await asyncio.Event().wait()  # the agent never answers

        def release(self, device: object) -> None:
            self.released.append(device)

    flow, device = StuckFlow(), object()
    stream = outline_flow.OutlineStream(flow, device, PLAIN_FORMAT, {"max_new_tokens": 8}, "h", ["a", "b"], True, {})
    closing = asyncio.create_task(stream.aclose())
    await flow.deleting.wait()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert flow.released == [device]
