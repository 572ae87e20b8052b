"""Token streamer: OpenAI-compatible HTTP/SSE and a WebSocket chat in front of device agents.

The user only ever talks to this service; it queues the request for a device
slot (admission.py: bounded, first come first served, with a deadline), picks a
device agent (router.py; a chat goes as its turns, which the device renders with
the model's own chat template, a completion as raw text), relays the device's
NDJSON token stream as OpenAI chunks, applies stop strings, measures TTFT/TBT as the user sees them (from
request arrival here, so queueing counts; run.py) and reports each finished request to
the state monitor (HAT §3.2) when one is configured. starter.py turns a request into a
started run; chat_ws.py is the WebSocket front over the same starter. state.py holds what the
requests share (clients, queue, metrics, background loops); routes.py is the routes over it.
A client that goes away, streaming or not, cancels its request: it leaves the
queue, or its device stream is closed, which stops the generation on the device
and frees its sessions there and in the cloud.
"""

from __future__ import annotations

from fastapi import FastAPI

from services.token_streamer.console import install as install_console
from services.token_streamer.limits import install as install_gate
from services.token_streamer.routes import api, install_error_handlers, probes
from services.token_streamer.settings import Settings, load_settings
from services.token_streamer.state import StreamerState


def create_app(settings: Settings | None = None) -> FastAPI:
    streamer = StreamerState(settings or load_settings())
    app = FastAPI(title="tophat token streamer", lifespan=streamer.lifespan)
    install_gate(app, streamer.settings)  # API keys, rate per credential, body size: answered before any parsing
    app.state.streamer = streamer
    install_error_handlers(app)
    app.include_router(api)
    app.include_router(probes)
    if streamer.console is not None:  # the web console: GET / and its data (console.py)
        install_console(app, streamer.console)
    return app
