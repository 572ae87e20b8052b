"""Discrete-event simulation of the Tophat mesh at HAT's testbed scale (`tophat simulate`).

Why: the real mesh runs a handful of devices on one box; HAT's claims are about 30
devices and a 4-8 stage cloud pipeline. The simulator replays the load generator's
traces through a model of the mesh whose timings come from the real mesh's telemetry
(g(mu), gamma, beta_up/down), checked against real runs at <= 4 devices, then scaled up.

Modules: events (clock, FIFO resources), calibration (+ fit: from the state monitor),
cloud (continuous batching over P stages; replicas), gpu_profile (g(mu) from a
GPU's measured passes), trees (measured tree rounds), budget (the draft budget per round), modes, session (one
request's event chain), run (a run / a grid, loadgen metrics), report (tables, sim vs real), cli. Import what you use
from those modules: this package re-exports nothing, so none of them imports the others through it.
"""
