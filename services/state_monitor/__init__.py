"""State monitor (HAT §3.2): turns telemetry into cloud load mu, g(mu) and device gamma/beta.

Run with `python -m services.state_monitor`; build the ASGI app with `create_app(settings)`.
"""

from services.state_monitor.app import create_app
from services.state_monitor.settings import ENV_PREFIX, Settings, load_settings

__all__ = ["ENV_PREFIX", "Settings", "create_app", "load_settings"]
