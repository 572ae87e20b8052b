"""Token streamer: the user-facing OpenAI-compatible (SSE) and WebSocket front of the mesh.

Run with `python -m services.token_streamer`; build the ASGI app with
`services.token_streamer.app.create_app(settings)`. Nothing is re-exported here: a package
__init__ that imports app.py makes every submodule's import run through app.py (an import cycle).
"""
