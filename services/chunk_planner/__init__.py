"""Chunk planner (HAT §3.3): prefill chunk sizes for devices' prompt uploads.

Run with `python -m services.chunk_planner`; build the ASGI app with
`services.chunk_planner.app.create_app(settings)`. Nothing is re-exported here, so importing a
submodule does not import app.py (no cycle through the package).
"""
