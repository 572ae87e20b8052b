"""`tophat bench sim-check`: the real mesh against `tophat simulate` calibrated from that same mesh.

Each mode runs on the real mesh; while the mesh is still up, the simulator is calibrated from its
telemetry (g(mu), gamma, beta as measured under this load) and the run's own accept lengths, replays
the same trace, and the two are printed side by side. A simulator that matches here is one whose
predictions at HAT's scale (30 devices) can be believed.
"""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import io
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from loadgen.bench import loadgen_options, modes_for
from loadgen.load_run import run_load_test
from loadgen.simulate.calibration import Calibration, demo_calibration
from loadgen.simulate.fit import cloud_state, from_telemetry
from loadgen.simulate.modes import SimMode, parse_modes
from loadgen.simulate.report import compare_with_real
from loadgen.simulate.run import SimConfig, simulate_grid
from services.device_agent.settings import load_settings
from shared.model.checkpoint import read_config
from shared.net.links import parse_link_spec, scaled_for_hidden
from shared.runtime import DEFAULT_SPLIT_LAYERS
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig
from tophatctl.mesh_ports import find_port_base


def calibrate_from_mesh(
    monitor_url: str, link: str, model_dir: str, cloud_before: dict[str, Any] | None = None
) -> Calibration:
    """The simulator's calibration from the mesh's telemetry, with bandwidth from the link's setting, and g(mu)
    from the verifier's steps since `cloud_before` (the monitor's /state/cloud before the run) where given.

    The devices' probes measure the same link (tests/services/verifier_cloud/test_verifier.py: within 15%), but a probe
    is a handful of samples taken while idle; the setting is what the emulation enforces
    (tests/tophatctl/test_netns.py: within 0.1%), so it is the less noisy input for a comparison. Latency
    is the other way round: the probed small-message round trip also holds both ends' framing
    and event-loop time, which the setting does not; the setting only fills in for a device
    that has not probed yet."""
    config = read_config(Path(model_dir))
    profile = scaled_for_hidden(parse_link_spec(link), config["hidden_size"])
    # the served model's shape (bytes per token on the wire, the middle's share of the layers), not the demo's
    base = dataclasses.replace(
        demo_calibration(),
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        split_layers=DEFAULT_SPLIT_LAYERS,
    )
    base = dataclasses.replace(
        base,
        devices=[
            dataclasses.replace(
                base.devices[0],
                beta_up=profile.uplink_bytes_s,
                beta_down=profile.downlink_bytes_s,
                latency_s=profile.latency_s,
            )
        ],
    )
    cal = from_telemetry(monitor_url, base=base, cloud_before=cloud_before)
    devices = [
        dataclasses.replace(d, beta_up=profile.uplink_bytes_s, beta_down=profile.downlink_bytes_s) for d in cal.devices
    ]
    return dataclasses.replace(
        cal, devices=devices, notes=[*cal.notes, f"bandwidth from the link's setting: {profile.describe()}"]
    )


def accept_dist_from_run(cal: Calibration, requests_csv: Path) -> Calibration:
    """The run's own tokens-per-round distribution (the streamer reports each delivery's token
    count; the first delivery is the prefill's token, not a verification round)."""
    counts: dict[int, int] = {}
    with open(requests_csv) as handle:
        for row in csv.DictReader(handle):
            per_delivery = [int(x) for x in row["chunk_tokens"].split()]
            for n in per_delivery[1:]:
                counts[n] = counts.get(n, 0) + 1
    if not counts:
        return cal
    longest = max(counts)
    dist: list[float] = [counts.get(n, 0) for n in range(1, longest + 1)]
    return dataclasses.replace(cal, accept_dist=dist, notes=[*cal.notes, f"accept_dist from the run: {dist}"])


def simulated_mode(mode: str) -> str:
    """The simulator's mode for a real one: hat's rounds are shaped by the draft budget wherever the devices run it
    (their default), so the simulator's hat-budget, which calls the same budget, is what hat ran."""
    return "hat-budget" if mode == "hat" and load_settings().budget_shapes() else mode


def sim_vs_real(
    *,
    workload: str,
    rates: list[float],
    num_requests: int,
    max_new_tokens: int,
    seed: int,
    out: Path,
    devices: int,
    link: str,
    model_dir: str,
    modes: list[str],
) -> str:
    """Run modes on the real mesh, calibrate the simulator from that mesh's own telemetry while
    it is still up (g(mu), gamma, beta as measured under this load), simulate the same traces,
    and print sim vs real side by side."""
    available = modes_for(workload)
    report = io.StringIO()
    config = MeshConfig(model_dir=model_dir, num_devices=devices, port_base=find_port_base(devices), link=link)
    with Mesh(config) as mesh:
        for rate in rates:
            with redirect_stdout(report):
                print(f"\n=== {workload} @ {rate:g} req/s, {devices} devices, link {link}")
            for mode in modes:
                run_dir = out / "sim-check" / mode / f"rate-{rate:g}"
                options = loadgen_options(
                    config.streamer_url,
                    workload,
                    rate,
                    num_requests,
                    max_new_tokens,
                    seed,
                    run_dir,
                    available[mode].request_options,
                    mesh.redis_url,
                    model_dir,
                )
                before = cloud_state(config.monitor_url)
                real = asyncio.run(run_load_test(options))
                # Calibrated after each mode's run, from the telemetry that mode produced (g(mu): the means of
                # its own steps; the devices' figures: the monitor's averages, which weigh recent requests most),
                # so each mode's latency models are the ones its own load measured.
                cal = calibrate_from_mesh(config.monitor_url, link, model_dir, before)
                cal = accept_dist_from_run(cal, run_dir / "requests.csv")
                cal.save(run_dir / "calibration.json")  # what the simulator was given, for a second look
                sim_config = SimConfig(
                    devices=devices,
                    stages=1,
                    workload=workload,
                    num_requests=num_requests,
                    seed=seed,
                    heterogeneous=False,
                    max_new_tokens=max_new_tokens,
                )
                sim_mode = simulated_mode(mode)
                sim_modes: list[SimMode | str] = [*parse_modes(sim_mode, workload)]
                grid = simulate_grid(cal, sim_modes, [rate], sim_config)
                with redirect_stdout(report):
                    print(
                        f"\n{mode}: calibration from the mesh's telemetry ({'; '.join(cal.notes)}); "
                        f"real accept length {real.get('mean_accept_length')}"
                    )
                    compare_with_real(grid, real, mode=sim_mode)
    return report.getvalue()
