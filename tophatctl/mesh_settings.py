"""What each process of a local mesh is told: its TOPHAT_* settings, read off the MeshConfig.

Pure functions (no process, no file): tophatctl/mesh.py adds the mesh-wide secret and TLS settings
and starts the processes with these.
"""

from __future__ import annotations

from tophatctl.mesh_config import MeshConfig
from tophatctl.mesh_ports import MONITOR_OFFSET, PLANNER_OFFSET, STREAMER_OFFSET

ANNOUNCE_INTERVAL_S = 0.5  # discovery mode: how often a device agent tells the state monitor it is there


def bind_env(config: MeshConfig, prefix: str) -> dict[str, str]:
    """A service's HOST setting when the mesh listens elsewhere than its default (loopback): `tophat serve --host`.
    Unset otherwise, so a TOPHAT_*_HOST in the caller's environment still applies, as before."""
    return {f"{prefix}HOST": config.bind_host} if config.bind_host else {}


def state_monitor_env(config: MeshConfig, bind: str, redis_url: str) -> dict[str, str]:
    return {
        "TOPHAT_STATE_MONITOR_PORT": str(config.port_base + MONITOR_OFFSET),
        "TOPHAT_STATE_MONITOR_HOST": bind,
        "TOPHAT_STATE_MONITOR_REDIS_URL": redis_url,
    }


def chunk_planner_env(config: MeshConfig, bind: str) -> dict[str, str]:
    return {
        "TOPHAT_CHUNK_PLANNER_PORT": str(config.port_base + PLANNER_OFFSET),
        "TOPHAT_CHUNK_PLANNER_HOST": bind,
        "TOPHAT_CHUNK_PLANNER_PIPELINE_STAGES": str(config.pipeline_stages),
        "TOPHAT_CHUNK_PLANNER_STATE_MONITOR_URL": config.monitor_url,
    }


def dtype_env(config: MeshConfig, prefix: str) -> dict[str, str]:
    """A named dtype for a service; none for "auto", so a service keeps its own environment's choice (else its
    default: int4 on a CPU, placement.CPU_DEFAULT)."""
    return {} if config.dtype.strip().lower() == "auto" else {f"{prefix}DTYPE": config.dtype}


def verifier_env(
    config: MeshConfig, replica: int, bind: str, model_dir: str, edge_env: dict[str, str]
) -> dict[str, str]:
    """Verifier replica `replica`'s settings; `edge_env` adds an edge pipeline's or edge draft server's."""
    return {
        "TOPHAT_VERIFIER_PORT": str(config.verifier_port + replica),
        "TOPHAT_VERIFIER_HOST": bind,
        "TOPHAT_VERIFIER_PIPELINE_STAGES": str(config.pipeline_stages),
        "TOPHAT_VERIFIER_MODEL_DIR": model_dir,
        "TOPHAT_VERIFIER_SPLIT_LAYERS": str(config.split_layers),
        **dtype_env(config, "TOPHAT_VERIFIER_"),
        "TOPHAT_VERIFIER_STATE_MONITOR_URL": config.monitor_url,
        **({"TOPHAT_VERIFIER_HIDDEN_ROTATION": config.hidden_rotation} if config.hidden_rotation else {}),
        **edge_env,
    }


def streamer_env(config: MeshConfig, device_urls: str, model_name: str) -> dict[str, str]:
    """`device_urls` empty: the streamer routes to whatever device agents announced themselves."""
    return {
        "TOPHAT_STREAMER_PORT": str(config.port_base + STREAMER_OFFSET),
        "TOPHAT_STREAMER_DEVICE_URLS": device_urls,
        "TOPHAT_STREAMER_STATE_MONITOR_URL": config.monitor_url,
        "TOPHAT_STREAMER_MODEL_NAME": model_name,  # what /v1/models lists: smollm2, demo, ...
        **bind_env(config, "TOPHAT_STREAMER_"),
        **({"TOPHAT_STREAMER_API_KEY": config.api_key} if config.api_key else {}),
    }


def device_env(config: MeshConfig, index: int, model_dir: str) -> dict[str, str]:
    """Device agent `index`'s settings, but for its port and id and how it reaches the cloud side (a device in a
    network namespace is then told to listen on every address of its namespace)."""
    return {
        "TOPHAT_DEVICE_MODEL_DIR": model_dir,
        "TOPHAT_DEVICE_SPLIT_LAYERS": str(config.split_layers),
        **dtype_env(config, "TOPHAT_DEVICE_"),
        "TOPHAT_DEVICE_ADAPTER": config.adapter,
        "TOPHAT_DEVICE_SPECULATIVE": str(config.speculative).lower(),
        "TOPHAT_DEVICE_MAX_DRAFT": str(config.max_draft),
        "TOPHAT_DEVICE_ETA": str(config.eta),
        "TOPHAT_DEVICE_LINK": config.per_device(config.link, index),
        "TOPHAT_DEVICE_SPEED": config.per_device(config.speed, index),
        **({"TOPHAT_DEVICE_HIDDEN_ROTATION": config.hidden_rotation} if config.hidden_rotation else {}),
        # a staged verifier refuses draft trees: the budget then chooses among the shapes it takes
        **({"TOPHAT_DEVICE_DRAFT_BUDGETS": "none,chain"} if config.pipeline_stages > 1 else {}),
        **bind_env(config, "TOPHAT_DEVICE_"),
        **{f"TOPHAT_DEVICE_{k.upper()}": v for k, v in config.device_env.items()},
    }


def announcing_device_env(config: MeshConfig, index: int, model_dir: str) -> dict[str, str]:
    """Discovery mode, as a container deployment runs: any free port, a host-name id, announced to the monitor."""
    return {
        **device_env(config, index, model_dir),
        **cloud_urls_env(config, config.host),
        "TOPHAT_DEVICE_DEVICE_ID": "auto",
        "TOPHAT_DEVICE_PORT": "0",
        "TOPHAT_DEVICE_ANNOUNCE_INTERVAL_S": str(ANNOUNCE_INTERVAL_S),
    }


def cloud_urls_env(config: MeshConfig, host: str) -> dict[str, str]:
    """Where a device agent finds the cloud side, reached at `host` (the veth's end for a namespace)."""
    return {
        "TOPHAT_DEVICE_VERIFIER_URL": config.device_verifier_url or config.verifier_urls(host),
        "TOPHAT_DEVICE_CHUNK_PLANNER_URL": f"{config.http_scheme}://{host}:{config.port_base + PLANNER_OFFSET}",
        "TOPHAT_DEVICE_STATE_MONITOR_URL": f"{config.http_scheme}://{host}:{config.port_base + MONITOR_OFFSET}",
    }
