"""The C++ extension (shared/model/native/): its build, keyed to what it was built from, and its loading.

`make install` builds it (`make native`, about 50 s with g++): torch.utils.cpp_extension into
build/native/<key>, where the key hashes the sources, the compiler flags, this CPU's feature flags (it is
built with -march=native), torch's version and Python's, so a stale or foreign build is never loaded. At
run time the .so is imported from that path; no compiler is needed. Where it is missing, does not load, or
TOPHAT_NATIVE_LAYERS=off, everything runs in torch (native_layers.py, invariant_attention.py). Where no C++
compiler is found (the one torch's builder calls: $CXX, else c++), or Python's headers are not installed (the
extension includes Python.h; Debian's python3-dev), the build is skipped with one line saying so, and
`make install` goes on: the runner then computes in torch. The ninja torch's builder runs is a dependency (the
ninja wheel); `make test-install` checks both ways in clean containers.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import platform
import shlex
import shutil
import sys
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "layers.cpp"  # it includes the headers beside it
MODULE = "tophat_native_layers"
BUILD_ROOT_ENV = "TOPHAT_NATIVE_DIR"  # where builds live (default: the checkout's build/native)
SWITCH_ENV = "TOPHAT_NATIVE_LAYERS"  # "off": never loaded, everything in torch
# -march=native: the attention loops vectorize with this CPU's widest registers, lane by lane, which changes
# no bit; no contraction of a * b + c into one fused multiply-add, so each product rounds as ATen's kernels do
# -fopenmp: at::parallel_for splits work between torch's OpenMP threads only in code built with it (its
# libgomp is the one torch loaded: same soname)
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def build_dir() -> Path:
    """This build's directory: one per (sources, flags, CPU, torch, Python), so a stale build is never found."""
    root = Path(os.environ.get(BUILD_ROOT_ENV) or Path(__file__).resolve().parents[2] / "build" / "native")
    key = hashlib.sha256()
    for path in sources():
        key.update(path.name.encode() + path.read_bytes())
    key.update(f"{torch.__version__} {sys.version_info[:2]} {CFLAGS} {LDFLAGS} {cpu_flags()}".encode())
    return root / key.hexdigest()[:16]


def sources() -> list[Path]:
    """The C++ file and the headers it includes (all of native/), in a fixed order."""
    return sorted(SOURCE.parent.glob("*.h")) + ([SOURCE] if SOURCE.exists() else [])


def cpu_flags() -> str:
    """This CPU's feature flags (the build targets the machine it is made on, -march=native)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def library_path() -> Path:
    return build_dir() / f"{MODULE}.so"


def compiler() -> str | None:
    """The C++ compiler torch.utils.cpp_extension would call ($CXX, else c++), where it is on PATH; else None."""
    command = shlex.split(os.environ.get("CXX", "c++")) or ["c++"]
    return shutil.which(command[0])


def no_compiler_message() -> str:
    name = (shlex.split(os.environ.get("CXX", "c++")) or ["c++"])[0]
    return (
        f"native layers: skipped, no C++ compiler ({name} is not on PATH; install g++ or set CXX): "
        "torch computes the int4/int8 layers, slower"
    )


def python_header() -> Path:
    """Where Python.h should be: the extension includes it (through torch/extension.h). Debian's python3 has
    it only with python3-dev; python.org's, pyenv's and the python images' builds always do."""
    return Path(sysconfig.get_paths()["include"]) / "Python.h"


def no_headers_message() -> str:
    return (
        f"native layers: skipped, no Python headers ({python_header()} is missing; install python3-dev): "
        "torch computes the int4/int8 layers, slower"
    )


def missing() -> str | None:
    """Why the extension cannot be built here (`make native`'s one line), or None where it can."""
    if compiler() is None:
        return no_compiler_message()
    if not python_header().is_file():
        return no_headers_message()
    return None


@contextlib.contextmanager
def ninja_on_path() -> Iterator[None]:
    """torch's builder runs `ninja` from PATH. The ninja wheel (a dependency) puts it in the venv, whose bin/
    is not on PATH where the venv's python runs unactivated (as make runs it): its directory goes first."""
    import ninja

    saved = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, *([saved] if saved else [])])
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = saved


def build() -> Path | None:
    """Compile the extension into `build_dir()` (about 50 s on 2 cores) unless it is there already; None, with
    one warning, where there is no C++ compiler or no Python headers to build it with."""
    target = library_path()
    if not target.exists():
        reason = missing()
        if reason is not None:
            log.warning(reason)
            return None
        from torch.utils.cpp_extension import load

        target.parent.mkdir(parents=True, exist_ok=True)
        with ninja_on_path():
            load(
                MODULE,
                [str(SOURCE)],
                build_directory=str(target.parent),
                extra_cflags=list(CFLAGS),  # copies: torch appends to the lists it is given, and they are in the key
                extra_ldflags=list(LDFLAGS),
                verbose=False,
            )
    return target


def build_summary() -> str:
    """`make native`'s one line: where the build is, or why there is none."""
    reason = None if library_path().exists() else missing()
    if reason is not None:
        return reason  # printed, not also logged
    return f"native layers: {build()}"


_loaded: ModuleType | None = None
_load_tried = False
_load_lock = threading.Lock()


def native_module() -> ModuleType | None:
    """The built extension, loaded once; None where it was not built, could not load, or is switched off."""
    if os.environ.get(SWITCH_ENV, "").lower() == "off":
        return None
    if not _load_tried:
        with _load_lock:  # pipeline stages may run their first passes in threads at once: one load
            _load_once()
    return _loaded


def _load_once() -> None:
    """Load the build (under _load_lock); marked tried only when done, so no thread sees a half-done load."""
    global _loaded, _load_tried
    if _load_tried:
        return
    path = library_path()
    if path.exists():
        try:
            spec = importlib.util.spec_from_file_location(MODULE, path)
            assert spec is not None and spec.loader is not None  # a file path always gives both
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _loaded = module
            log.info("native layers loaded from %s", path)
        except ImportError as error:
            log.warning("native layers at %s do not load (%s): torch computes everything", path, error)
    else:
        log.info("native layers not built (%s): torch computes everything", path)
    _load_tried = True


def native_attention(*tensors: torch.Tensor) -> ModuleType | None:
    """The extension, for batch-invariant attention over these tensors (float32 on the CPU), or None.

    native_layers.python_runner() does not switch it off: the reference model, the Python runner and the
    C++ layers in one process must all attend with the same kernel to compute the same bits."""
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    return native_module()
