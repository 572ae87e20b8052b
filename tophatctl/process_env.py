"""The environment one process of a local mesh starts with: the launcher's, the mesh's, the service's own, and
of the mesh's credentials only that service's (a device agent never sees a cloud service's credential).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from tophatctl.mesh_credentials import AUTH_KEYS, SETTINGS_PREFIX


def process_env(
    module: str,
    env: Mapping[str, str],
    *,
    tls_env: Mapping[str, str],
    extra_env: Mapping[str, str],
    tether_env: Mapping[str, str],
    auth_env: Mapping[str, str],
) -> dict[str, str]:
    """`python -m module`'s environment: os.environ, unbuffered single-threaded defaults, the mesh's TLS
    settings, its `extra_env`, the service's own `env` and the launcher's tether, each over the one before;
    then the mesh's credentials (`auth_env`) for this service, under what `extra_env` or `env` sets."""
    full_env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        **tls_env,
        **extra_env,
        **env,
        **tether_env,
    }
    own = SETTINGS_PREFIX[module]
    # A credential inherited from the launcher's environment or the mesh's is dropped unless it is this service's.
    full_env = {
        k: v
        for k, v in full_env.items()
        if not (k.startswith("TOPHAT_") and k.endswith(AUTH_KEYS) and not k.startswith(own))
    }
    full_env.update({k: v for k, v in auth_env.items() if k.startswith(own) and k not in extra_env and k not in env})
    return full_env
