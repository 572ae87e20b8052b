"""`tophat bench disco`: DiSCo against device-only, cloud-only and a random split (DiSCo §5).

One mesh per cost regime; on it the load generator's trace (same arrivals, same prompts, same
seed) is replayed once per policy, each a `tophat.dispatch` of the token streamer:

    device   the device's draft model alone              (does not depend on b: run once)
    cloud    the whole model in the verifier, token ids  (does not depend on b: run once)
    random   Stoch-S / Stoch-D: one endpoint at random within the budget b
    disco    DiSCo's dispatch (eqs. 1-3) and token-level migration (eqs. 4-5)

The baselines run first. DiSCo profiles the server's TTFT distribution and the prompt lengths
offline; here the state monitor's history (`GET /disco/history`: every request's prompt length,
and the server's TTFT whenever the server gave the first token) is filled by the device and cloud
runs, so the disco runs start from a profiled history instead of racing everything ("no-history").

The mesh (defaults chosen so the trade-off DiSCo exploits exists on one host):
* link `far,lat=50ms,jitter=25ms`: a wide-area round trip of ~100 ms that varies request to
  request, so the server's TTFT has a spread (and a tail) on top of its prefill time;
* device speed `10` (a slowdown; the emulated testbed's `cycle` class reaches 10x): the device's
  prefill is ~3x slower per token than the verifier's here, so its TTFT grows past the server's
  for long prompts while it wins short ones (no round trip);
* devices hold 16 sessions each: under a policy delivery is paced at the reading rate and a request
  keeps its device slot until its last token is read, so the default 4 would queue requests
  behind reading time, not compute.
Cost regimes (`--constraint`): `server` keeps the streamer's prices (server $ per token far above
the device's energy); `device` raises the exchange rate to DEVICE_EXCHANGE_RATE $/J so device
energy dominates; `both` runs the two meshes one after the other.

The results (aggregation, ratios, Pareto front, the table, the plot) are pure, in loadgen/disco_results.py,
tested by hand-made inputs in tests/e2e/test_bench_disco.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any, Sequence

from loadgen.disco_results import Policy, aggregate, compare, format_tables, plot_cost_ttft

# the Pareto test, tests/e2e/test_bench_disco.py, reads dominators here beside the rest of the bench
from loadgen.disco_results import dominators as dominators
from loadgen.metrics import RequestRecord

log = logging.getLogger(__name__)

BUDGETS = (0.1, 0.25, 0.5, 0.75)
DEFAULT_LINK = "far,lat=50ms,jitter=25ms"
DEFAULT_SPEED = "10"
DEFAULT_RATE = 2.0  # req/s
DEVICE_SESSIONS = 16
DEVICE_EXCHANGE_RATE = 1e-3  # $/J: device energy above every server price (Algorithm 1 says "device")
HISTORY_REFRESH_S = 1.0  # the streamer re-reads the monitor's history this often during the bench
CONSTRAINTS = ("server", "device")


def policy_plan(budgets: Sequence[float]) -> list[Policy]:
    """Run order: the baselines that do not depend on b first (they fill the history), then per budget
    random and disco."""
    plan = [Policy("device", None), Policy("cloud", None)]
    for b in budgets:
        plan += [Policy("random", b), Policy("disco", b)]
    return plan


def parse_budgets(text: str) -> list[float]:
    budgets = [float(x) for x in text.split(",") if x.strip()]
    if not budgets or any(not (0.0 <= b <= 1.0) for b in budgets):  # NaN fails the comparison too
        raise ValueError(f"--budget must be numbers in [0, 1], comma-separated, got {text!r}")
    return list(dict.fromkeys(budgets))


def parse_constraint(text: str) -> list[str]:
    if text == "both":
        return list(CONSTRAINTS)
    if text not in CONSTRAINTS:
        raise ValueError(f"--constraint must be server, device or both, got {text!r}")
    return [text]


def request_options(policy: Policy, reading_rate_tps: float, migration: bool = True) -> dict[str, Any]:
    """The request body's `tophat` object for one policy."""
    options: dict[str, Any] = {"dispatch": policy.mode, "reading_rate_tps": reading_rate_tps}
    if policy.budget is not None:
        options["budget"] = policy.budget
    if policy.mode == "disco":
        options["migration"] = migration
    return options


def mesh_env(constraint: str) -> dict[str, str]:
    """Mesh-wide settings: the whole model in the verifier (cloud-only needs it), a fresh history,
    and for the device-constrained regime an exchange rate that makes device energy dominate."""
    env = {
        "TOPHAT_VERIFIER_FULL_MODEL": "true",
        "TOPHAT_STREAMER_DISCO_REFRESH_S": f"{HISTORY_REFRESH_S:g}",
        "TOPHAT_STREAMER_DISCO_SEED": "0",
    }  # the random baseline's choices repeat from run to run
    if constraint == "device":
        env["TOPHAT_STREAMER_EXCHANGE_RATE"] = f"{DEVICE_EXCHANGE_RATE:g}"
    return env


def mesh_config(constraint: str, *, model_dir: str, devices: int, link: str, speed: str):
    """The mesh of one cost regime (see the module docstring for the choices)."""
    from tophatctl.mesh_config import MeshConfig
    from tophatctl.mesh_ports import find_port_base

    return MeshConfig(
        model_dir=model_dir,
        num_devices=devices,
        port_base=find_port_base(devices),
        link=link,
        speed=speed,
        extra_env=mesh_env(constraint),
        device_env={"max_sessions": str(DEVICE_SESSIONS)},
    )  # the launcher adds TOPHAT_DEVICE_


def output_paths(out: Path) -> tuple[Path, Path]:
    """(the results JSON, the folder for per-run outputs): `--out x.json` or a folder (disco.json in it)."""
    json_path = out if out.suffix == ".json" else out / "disco.json"
    return json_path, json_path.with_name(f"{json_path.stem}-runs")


# -- the bench ----------------------------------------------------------------------------------
def save_streamer_stats(path: Path, records: Sequence[RequestRecord]) -> None:
    """One line per request: its prompt length, TTFT and the streamer's `tophat` object (decision,
    legs, cost, migrations), beside the load generator's requests.csv."""
    from loadgen.metrics import ttft_s

    with path.open("w") as handle:
        for r in records:
            ttft = ttft_s(r)
            handle.write(
                json.dumps(
                    {
                        "index": r.index,
                        "prompt_tokens": r.prompt_tokens,
                        "error": r.error,
                        "ttft_ms": None if ttft is None else ttft * 1e3,
                        "tophat": r.tophat,
                    },
                    default=str,
                )
                + "\n"
            )


def _history_sizes(monitor_url: str) -> dict[str, int] | None:
    """How many prompt lengths and server TTFTs the monitor holds (what disco's policy is built from)."""
    import httpx

    try:
        body = httpx.get(f"{monitor_url}/disco/history", timeout=5.0, trust_env=False).raise_for_status().json()
        return {k: len(body.get(k) or []) for k in ("prompt_tokens", "server_ttft_s")}
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        log.warning("cannot read the monitor's DiSCo history: %s", exc)
        return None


def run_disco(
    *,
    constraint: str,
    budgets: Sequence[float],
    workload: str,
    rate: float,
    num_requests: int,
    max_new_tokens: int,
    seed: int,
    runs_dir: Path,
    devices: int,
    link: str,
    speed: str,
    model_dir: str,
    reading_rate_tps: float,
    migration: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every policy on one mesh of this cost regime, back to back: (entries, notes about the run)."""
    from loadgen.bench import loadgen_options
    from loadgen.load_run import run_load_test
    from tophatctl.mesh import Mesh

    config = mesh_config(constraint, model_dir=model_dir, devices=devices, link=link, speed=speed)
    entries: list[dict[str, Any]] = []
    notes: dict[str, Any] = {"constraint": constraint, "link": link, "speed": speed, "devices": devices}
    with Mesh(config) as mesh:
        for policy in policy_plan(budgets):
            if policy.mode == "disco" and "history_before_disco" not in notes:
                time.sleep(HISTORY_REFRESH_S * 2)  # the streamer has re-read the baselines' history
                notes["history_before_disco"] = _history_sizes(config.monitor_url)
            log.info("%s-constrained: %s, %s @ %g req/s", constraint, policy.label, workload, rate)
            records: list[RequestRecord] = []
            run_dir = runs_dir / constraint / policy.label
            options = loadgen_options(
                config.streamer_url,
                workload,
                rate,
                num_requests,
                max_new_tokens,
                seed,
                run_dir,
                request_options(policy, reading_rate_tps, migration),
                mesh.redis_url,
                model_dir,
            )
            asyncio.run(run_load_test(options, records))
            save_streamer_stats(run_dir / "tophat.jsonl", records)
            entries.append(
                aggregate(
                    records,
                    mode=policy.mode,
                    budget=policy.budget,
                    constraint=constraint,
                    reading_rate_tps=reading_rate_tps,
                )
            )
    return entries, notes


def bench_disco(
    *,
    constraints: Sequence[str],
    budgets: Sequence[float],
    workload: str,
    rate: float,
    num_requests: int,
    max_new_tokens: int,
    seed: int,
    out: Path,
    devices: int,
    link: str,
    speed: str,
    model_dir: str,
    reading_rate_tps: float,
    migration: bool = True,
) -> tuple[str, Path, list[Path]]:
    """Run every regime, write the JSON, the table and the plots: (table, JSON path, PNG paths)."""
    json_path, runs_dir = output_paths(out)
    entries: list[dict[str, Any]] = []
    meshes = []
    for constraint in constraints:
        got, notes = run_disco(
            constraint=constraint,
            budgets=budgets,
            workload=workload,
            rate=rate,
            num_requests=num_requests,
            max_new_tokens=max_new_tokens,
            seed=seed,
            runs_dir=runs_dir,
            devices=devices,
            link=link,
            speed=speed,
            model_dir=model_dir,
            reading_rate_tps=reading_rate_tps,
            migration=migration,
        )
        entries += got
        meshes.append(notes)
    title = (
        f"DiSCo bench: {workload} @ {rate:g} req/s, {num_requests} requests/policy, max_tokens {max_new_tokens}, "
        f"r_c {reading_rate_tps:g} tok/s, link {link}, device speed {speed}, {devices} device(s)"
    )
    table = format_tables(entries, title)
    compared = {(c["constraint"], c["budget"]): c for c in compare(entries)}
    saved = [compared.get((e["constraint"], e["budget"]), e) if e["mode"] == "disco" else e for e in entries]
    config = {
        "workload": workload,
        "rate": rate,
        "num_requests": num_requests,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "devices": devices,
        "link": link,
        "speed": speed,
        "model": model_dir,
        "reading_rate_tps": reading_rate_tps,
        "budgets": list(budgets),
        "migration": migration,
        "device_exchange_rate": DEVICE_EXCHANGE_RATE,
        "meshes": meshes,
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"config": config, "entries": saved}, indent=2, default=str) + "\n")
    json_path.with_suffix(".txt").write_text(table + "\n")
    plots = [
        plot_cost_ttft(
            [e for e in entries if e["constraint"] == c],
            json_path.with_name(f"{json_path.stem}-{c}.png"),
            f"{c}-constrained - {title}",
        )
        for c in constraints
    ]
    return table, json_path, plots
