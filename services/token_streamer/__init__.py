"""Token streamer: the user-facing OpenAI-compatible (SSE) and WebSocket front of the mesh.

Run with `python -m services.token_streamer`; build the ASGI app with `create_app(settings)`.
"""

from services.token_streamer.app import create_app
from services.token_streamer.settings import ENV_PREFIX, Settings, load_settings

__all__ = ["ENV_PREFIX", "Settings", "create_app", "load_settings"]
