"""A service module run as a process that stops when its launcher dies (`tophatctl.tethered MODULE [ARGS]` runs
`MODULE [ARGS]` as `__main__`).

The local mesh starts every service this way (tophatctl/service_process.py), so a `tophat serve` or a
benchmark killed with SIGKILL leaves no service behind holding its port: the watch on the launcher's
tether (shared/processes/lifeline.py) starts before the module, so it covers a model still loading too.
"""

from __future__ import annotations

import runpy
import sys

from shared.processes.lifeline import watch_tether


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m tophatctl.tethered MODULE [ARGS...]")
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]  # as `python -m MODULE` shows them (run_module sets argv[0] to its file)
    watch_tether()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
