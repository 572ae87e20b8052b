"""The `tophat` command line as a whole (issue 46, "One CLI"): `tophat --help` is fast because importing the app
loads neither torch nor transformers (every command imports what it runs inside its body)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_python(*args: str) -> subprocess.CompletedProcess:
    """A fresh interpreter in the repository root (its modules first on the path), as `tophat` runs."""
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)


def test_importing_the_app_loads_no_model_library():
    code = "import sys, tophat.cli; print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))"
    assert run_python("-c", code).stdout.strip() == ""


def test_help_is_fast():
    start = time.monotonic()
    result = run_python("-m", "tophat", "--help")
    elapsed = time.monotonic() - start
    assert "serve" in result.stdout or "up" in result.stdout
    assert elapsed < 1.5, f"`tophat --help` took {elapsed:.2f} s"


def test_version_is_the_distributions():
    from importlib.metadata import version

    from typer.testing import CliRunner

    from tophat.cli import app

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"tophat {version('tophat')}"


# ---- tophat serve: its options from --config, TOPHAT_* variables and the command line ---------------------------


def serve_config(monkeypatch, args: list[str], env: dict[str, str] | None = None):
    """The MeshConfig `tophat serve ARGS` would start (no mesh: the fake Mesh refuses to start), and the result."""
    from typer.testing import CliRunner

    import tophatctl.mesh
    from tophat.cli import app
    from tophatctl.mesh_config import MeshStartError

    seen = []

    class NoMesh:
        def __init__(self, config):
            seen.append(config)
            raise MeshStartError("no mesh in this test")

    monkeypatch.setattr(tophatctl.mesh, "Mesh", NoMesh)
    result = CliRunner().invoke(app, ["serve", "--model", "demo", *args], env=env)
    return (seen[0] if seen else None), result


def test_serve_reads_toml_and_yaml_and_the_command_line_wins(monkeypatch, tmp_path):
    toml = tmp_path / "mesh.toml"
    toml.write_text('devices = 3\nport-base = 9100\nlink_mode = "inprocess"\n')
    yaml = tmp_path / "mesh.yaml"
    yaml.write_text("devices: 3\nport: 9100\nlink-mode: inprocess\n")
    for path in (toml, yaml):
        config, result = serve_config(monkeypatch, ["--config", str(path)])
        assert (config.num_devices, config.port_base, config.link_mode) == (3, 9100, "inprocess"), result.output
        config, _ = serve_config(monkeypatch, ["--config", str(path), "--devices", "2"])
        assert (config.num_devices, config.port_base) == (2, 9100)  # the flag over the file, the file over defaults


def test_serve_config_refuses_an_unknown_key(monkeypatch, tmp_path):
    path = tmp_path / "mesh.toml"
    path.write_text("devices = 2\nmax_devices = 4\n")
    config, result = serve_config(monkeypatch, ["--config", str(path)])
    assert config is None and result.exit_code == 2
    assert "unknown key 'max_devices'" in result.output


def test_serve_config_refuses_other_formats(monkeypatch, tmp_path):
    path = tmp_path / "mesh.json"
    path.write_text("{}")
    config, result = serve_config(monkeypatch, ["--config", str(path)])
    assert config is None and result.exit_code == 2 and "TOML" in result.output


def test_serve_env_vars_and_host(monkeypatch, tmp_path):
    config, _ = serve_config(monkeypatch, [], env={"TOPHAT_DEVICES": "2", "TOPHAT_PORT": "9200"})
    assert (config.num_devices, config.port_base) == (2, 9200)
    assert (config.host, config.bind) == ("127.0.0.1", "127.0.0.1")  # loopback by default
    config, _ = serve_config(monkeypatch, ["--host", "0.0.0.0"])
    assert (config.host, config.bind) == ("127.0.0.1", "0.0.0.0")  # every interface, reached over loopback
    config, _ = serve_config(monkeypatch, ["--host", "10.1.2.3"])
    assert (config.host, config.bind) == ("10.1.2.3", "10.1.2.3")
    config, result = serve_config(monkeypatch, ["--host", "fe80::1"])
    assert config is None and result.exit_code == 2 and "IPv6" in result.output


def test_serve_help_names_its_env_vars_and_up_is_an_alias():
    from typer.testing import CliRunner

    from tophat.cli import app

    runner = CliRunner()
    text = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    for name in ("TOPHAT_MODEL", "TOPHAT_DTYPE", "TOPHAT_HOST", "TOPHAT_PORT", "TOPHAT_DEVICES"):
        assert name in text
    assert "0.0.0.0" in text
    assert runner.invoke(app, ["up", "--help"]).exit_code == 0
    import typer.main

    root = typer.main.get_command(app)
    ctx = root.context_class(root)
    assert root.get_command(ctx, "up").hidden and not root.get_command(ctx, "serve").hidden


def test_the_services_bind_the_serve_host():
    from tophatctl.mesh_config import MeshConfig, serve_hosts
    from tophatctl.mesh_settings import device_env, streamer_env

    exposed = MeshConfig(model_dir="demo", **serve_hosts("0.0.0.0"))
    assert streamer_env(exposed, "", "demo")["TOPHAT_STREAMER_HOST"] == "0.0.0.0"
    assert device_env(exposed, 0, "/m")["TOPHAT_DEVICE_HOST"] == "0.0.0.0"
    assert exposed.streamer_url.startswith("http://127.0.0.1:")
    local = MeshConfig(model_dir="demo")
    assert "TOPHAT_STREAMER_HOST" not in streamer_env(local, "", "demo")  # the services' own default (loopback)


# ---- tophat bench KIND: one subcommand per bench, each with only its own options -------------------------------


def bench_help(*kind: str) -> str:
    from typer.testing import CliRunner

    from tophat.cli import app

    result = CliRunner().invoke(app, ["bench", *kind, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


def test_no_python_dash_m_left_for_a_user_task():
    """The README, the docs (not the dated benchmark reports) and the Makefile run `tophat ...`: a `python -m`
    left is a service in its image (`python -m services.<name>`, its healthcheck) or the test runner."""
    import re

    allowed = re.compile(r"python -m\s+(services\.|tophatctl\.healthcheck|pytest|venv|tophat\.docs_gen)")
    pages = [REPO / "README.md", REPO / "Makefile", *(REPO / "docs").glob("*.md"), *(REPO / "docs").glob("[!b]*/*.md")]
    for page in pages:
        text = re.sub(r"\$\((BIN|PY)\)/python|\$\(PY\)", "python", page.read_text(encoding="utf-8"))
        for match in re.finditer(r"python -m\s+\S+", text):
            assert allowed.match(match.group(0)), (page.name, match.group(0))


def test_the_old_mode_flags_are_gone():
    from typer.testing import CliRunner

    from tophat.cli import app

    for flag in ("--disco", "--edge-pipeline", "--edge-sd", "--ablation", "--sim-check", "--link-profile"):
        result = CliRunner().invoke(app, ["bench", flag])
        assert result.exit_code == 2, (flag, result.output)
        assert flag not in bench_help("serve")


MESH_BENCH = {"--model", "--out", "--max-new-tokens", "--seed", "--help"}
LOAD = {"--rates", "--link", "--devices", "--num-requests"}
CORE = {
    "--model",
    "--adapter",
    "--split-layers",
    "--prompts",
    "--max-new-tokens",
    "--eta",
    "--max-draft",
    "--threads",
    "--dtype",
    "--help",
}
BENCH_OPTIONS = {  # each bench's options, exactly: its own and none of another bench's
    "serve": MESH_BENCH | LOAD | {"--workload", "--modes", "--rtt-ms", "--baseline", "--dtype", "--repeats"},
    "ablation": MESH_BENCH | LOAD | {"--rtt-ms", "--dtype"},
    "sim-check": MESH_BENCH | LOAD | {"--workload", "--modes"},
    "disco": MESH_BENCH
    | {
        "--rate",
        "--link",
        "--devices",
        "--num-requests",
        "--workload",
        "--budget",
        "--constraint",
        "--speed",
        "--reading-rate",
        "--migration",
        "--no-migration",
    },
    "jupiter": MESH_BENCH | {"--edge-pipeline", "--lan", "--buckets", "--per-bucket", "--modes"},
    "edge-sd": MESH_BENCH | {"--tasks", "--rounds", "--bandwidth-mhz", "--sbs-slowdown", "--modes"},
    "core": CORE | {"--rtt-ms"},
    "trees": CORE | {"--nodes", "--tree-width", "--tree-min-prob", "--rtt-ms", "--out"},
    "budget": CORE | {"--shapes", "--rtt-ms", "--link", "--tree-width", "--tree-min-prob", "--out"},
    "engine": {
        "--model",
        "--split-layers",
        "--new-tokens",
        "--dtypes",
        "--threads",
        "--profile",
        "--quality-positions",
        "--quality-prompts",
        "--runs",
        "--out",
        "--help",
    },
    "gpu": {
        "--model",
        "--weights",
        "--adapter",
        "--split-layers",
        "--device",
        "--dtype",
        "--new-tokens",
        "--sessions",
        "--hf-sessions",
        "--rows",
        "--context",
        "--repeats",
        "--greedy-prompts",
        "--greedy-tokens",
        "--eta",
        "--max-draft",
        "--stages",
        "--time-budget-s",
        "--threads",
        "--out",
        "--help",
    },
    "compile": {"--model", "--dtype", "--threads", "--help"},
    "idle": {"--model", "--dtype", "--split-layers", "--rows", "--gap-ms", "--passes", "--rounds", "--help"},
    "batch-invariance": {"--model", "--dtypes", "--prompts", "--new-tokens", "--threads", "--attention", "--help"},
    "topk-tv": {
        "--model",
        "--adapter",
        "--split-layers",
        "--prompts",
        "--positions",
        "--temperatures",
        "--ks",
        "--out",
        "--help",
    },
    "hat": {
        "--model",
        "--adapter",
        "--link",
        "--link-mode",
        "--devices",
        "--prompt-tokens",
        "--repeats",
        "--max-new-tokens",
        "--help",
    },
    "picospec": {
        "--model",
        "--rtt-ms",
        "--modes",
        "--prompts",
        "--max-new-tokens",
        "--eta",
        "--max-draft",
        "--group",
        "--window",
        "--no-eta-gate",
        "--downlink",
        "--top-k",
        "--out",
        "--help",
    },
    "wire": {"--help"},
    "fuzz-wire": {"--model", "--split-layers", "--frames", "--seed", "--help"},
    "disco-overhead": {"--sizes", "--decisions", "--budget", "--alpha", "--seed", "--json", "--help"},
    "soak": {
        "--model",
        "--duration",
        "--rate",
        "--devices",
        "--warmup-requests",
        "--warmup-s",
        "--max-new-tokens",
        "--seed",
        "--rss-max-growth-pct",
        "--rss-min-growth-mib",
        "--help",
    },
    "aiperf": {
        "--aiperf",
        "--model",
        "--requests",
        "--concurrency",
        "--input-tokens",
        "--output-tokens",
        "--request-timeout-s",
        "--aiperf-timeout-s",
        "--ready-timeout-s",
        "--out",
        "--help",
    },
}


def test_each_bench_lists_its_own_options_and_not_the_others():
    import re

    kinds = re.findall(r"^│ ([a-z][a-z-]+) ", bench_help(), flags=re.MULTILINE)
    assert kinds == list(BENCH_OPTIONS)
    for kind, options in BENCH_OPTIONS.items():
        assert set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", bench_help(kind))) == options, kind


def test_bench_serve_passes_its_options_to_the_mode_bench(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import loadgen.bench_command as bench_command
    from tophat.cli import app

    seen = []
    monkeypatch.setattr(bench_command, "check_draft_adapter", lambda model_dir: None)
    monkeypatch.setattr(bench_command, "run_mode_bench", lambda plan, served: seen.append(plan) or iter(["TABLE"]))
    args = ["--model", "demo", "--link", "mid", "--rtt-ms", "20", "--modes", "ushape,hat", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, ["bench", "serve", *args])
    assert result.exit_code == 0, result.output
    assert "TABLE" in result.output
    assert seen[0].runs == ((20.0, "mid,lat=10ms"),) and seen[0].modes == ("ushape", "hat") and not seen[0].ablation
    result = CliRunner().invoke(app, ["bench", "ablation", "--model", "demo", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert seen[1].ablation and seen[1].workloads == ("specbench", "cnndm")
    result = CliRunner().invoke(app, ["bench", "serve", "--model", "demo", "--modes", "warp"])
    assert result.exit_code == 2 and "unknown modes" in result.output
