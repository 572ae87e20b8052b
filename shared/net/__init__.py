"""The links between device and cloud and how the mesh lives with them: link profiles (links.py) and their
in-process emulation (shaper.py), the one retry backoff, stream heartbeats and per-credential rate limiting."""
