"""State monitor (HAT §3.2): turns telemetry into cloud load mu, g(mu) and device gamma/beta.

Run with `python -m services.state_monitor`; build the ASGI app with
`services.state_monitor.app.create_app(settings)`. Nothing is re-exported here, so importing a
submodule does not import app.py (no cycle through the package).
"""
