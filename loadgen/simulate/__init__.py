"""Discrete-event simulation of the Tophat mesh at HAT's testbed scale (`tophat simulate`).

Why: the real mesh runs a handful of devices on one box; HAT's claims are about 30
devices and a 4-8 stage cloud pipeline. The simulator replays the load generator's
traces through a model of the mesh whose timings come from the real mesh's telemetry
(g(mu), gamma, beta_up/down), checked against real runs at <= 4 devices, then scaled up.

Modules: events (clock, FIFO resources), calibration (+ fit: from the state monitor),
cloud (continuous batching over P stages), modes, session (one request's event chain),
run (a run / a grid, loadgen metrics), report (tables, sim vs real), cli.
"""

from loadgen.simulate.calibration import Calibration, DeviceProfile, GTable, demo_calibration, paper_calibration
from loadgen.simulate.modes import Mode, parse_mode, parse_modes
from loadgen.simulate.report import compare_with_real, grid_tables, rate_table
from loadgen.simulate.run import SimConfig, SimRun, build_requests, run_simulation, simulate, simulate_grid

__all__ = [
    "Calibration", "DeviceProfile", "GTable", "demo_calibration", "paper_calibration",
    "Mode", "parse_mode", "parse_modes",
    "compare_with_real", "grid_tables", "rate_table",
    "SimConfig", "SimRun", "build_requests", "run_simulation", "simulate", "simulate_grid",
]
