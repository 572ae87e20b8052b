"""The web console's data, pure bookkeeping over what the token streamer holds: the plotted history
(history.py) and the per-device and per-verifier view of the mesh (mesh.py)."""
