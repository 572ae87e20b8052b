"""One load-generator run: arrivals, workload, send and record, statistics, outputs on disk.

Shared by `tophat loadgen` (loadgen/cli.py) and every bench that drives a mesh (loadgen/bench*.py),
so a bench's numbers are the load generator's numbers.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

DEVICE_HINT_NOTE = (
    "device_hint is recorded per request but not sent: the token streamer builds the device "
    "request from fixed fields and does not forward extra body fields (nor a device choice)"
)


async def run_load_test(o: dict[str, Any], records_out: list | None = None) -> dict[str, Any]:
    """One `tophat loadgen` run with `o`, every option by name (loadgen/cli.py, or
    loadgen.bench.loadgen_options for the benches); writes results.json, requests.csv and the plots
    under o["out"] and returns results.json's contents. Its per-request records are appended to
    `records_out` when given (benches that need more than results.json holds, e.g. each request's
    `tophat` object). Heavy modules are imported here, so importing this module costs nothing."""
    from loadgen import arrivals as arr
    from loadgen import metrics, plots, runner
    from loadgen import workloads as wl
    from tophatctl.models import resolve_model

    times = arr.arrival_times(
        o["rate"], o["burstiness"], num_requests=o["num_requests"], duration=o["duration"], seed=o["seed"]
    )
    if len(times) == 0:
        raise ValueError("no arrivals in that duration; raise --rate or --duration")
    probe = await runner.probe_server(o["url"], api_key=o.get("api_key"))
    if not probe["reachable"]:
        raise ValueError(f"cannot reach {o['url']}: {probe['error']}")
    num_devices = o["num_devices"] or probe["num_devices"] or 1
    notes = [] if o["send_device_hint"] else [DEVICE_HINT_NOTE]

    tok_path = resolve_model(o["tokenizer"])
    builtin = wl.BUILTIN.get(o["workload"])
    tok = wl.load_tokenizer(tok_path) if builtin or (tok_path / "tokenizer_config.json").exists() else None
    if builtin:
        assert tok is not None, "a built-in workload's tokenizer is loaded above"
        limit = o["context_limit"] or wl.context_limit_of(tok_path)
        work = wl.synthetic_workload(
            builtin,
            len(times),
            tokenizer=tok,
            max_new_tokens=o["max_new_tokens"],
            context_limit=limit,
            seed=o["seed"],
            num_devices=num_devices,
            dist=o["length_dist"],
        )
    elif Path(o["workload"]).is_file():
        work = wl.file_workload(
            o["workload"], len(times), max_new_tokens=o["max_new_tokens"], tokenizer=tok, num_devices=num_devices
        )
    else:
        raise ValueError(f"--workload must be specbench, cnndm or an existing JSONL file, got {o['workload']!r}")

    cfg = runner.RunConfig(
        url=o["url"],
        model=o["model"] or probe["model"],
        temperature=o["temperature"],
        request_timeout_s=o["request_timeout"],
        max_concurrency=o["max_concurrency"],
        extra_body=o["body_extra"],
        send_device_hint=o["send_device_hint"],
        progress=o["progress"],
        api_key=o.get("api_key"),
    )
    count = (lambda text: len(tok(text, add_special_tokens=False)["input_ids"])) if tok is not None else None
    run = await runner.run_load(work.requests, times.tolist(), cfg, count_tokens=count)
    if records_out is not None:
        records_out.extend(run.records)
    if count is None:
        notes.append("no tokenizer: tokens per chunk apportioned by characters")

    steps: list[dict[str, float]] = []
    if o["redis_url"]:
        steps, note = await runner.fetch_verifier_steps(o["redis_url"], run.started_wall, run.ended_wall)
        notes += [note] if note else []
    else:
        notes.append("no --redis-url: per-step cloud compute delay not collected")
    cloud_state = await runner.fetch_cloud_state(o["state_monitor_url"]) if o["state_monitor_url"] else None

    slos = {
        k: v
        for k, v in (("ttft", o["slo_ttft_ms"]), ("tpot", o["slo_tpot_ms"]), ("e2el", o["slo_e2el_ms"]))
        if v is not None
    }
    slas = {k: v for k, v in (("prefill", o["prefill_sla_ms"]), ("decode", o["decode_sla_ms"])) if v is not None}
    results = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "url": o["url"],
        "model": cfg.model,
        "workload": work.name,
        "workload_stats": work.stats,
        "num_prompts": len(work.requests),
        "request_rate": "inf" if math.isinf(o["rate"]) else o["rate"],
        "burstiness": o["burstiness"],
        "duration_limit_s": o["duration"],
        "max_new_tokens": o["max_new_tokens"],
        "seed": o["seed"],
        "max_concurrency": o["max_concurrency"],
        "temperature": o["temperature"],
        "num_devices": num_devices,
        "extra_body": o["body_extra"] or None,
        "tokenizer": str(tok_path) if tok is not None else None,
        **metrics.build_results(run.records, slos_ms=slos, sla_thresholds_ms=slas),
    }
    if steps:
        delays = [s["compute_s"] * 1e3 for s in steps]
        results["cloud_compute_delay"] = {
            "steps": len(delays),
            "mean_ms": sum(delays) / len(delays),
            "std_ms": population_std(delays),
        }
    results["cloud_state"] = cloud_state
    results["notes"] = notes
    out_dir: Path = o["out"]
    runner.save_outputs(out_dir, results, run.records)
    title = f"{work.name} @ {results['request_rate']} req/s, B={o['burstiness']:g}"
    plots.write_plots(run.records, results, out_dir, title, steps)
    return results


def population_std(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return (sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5
