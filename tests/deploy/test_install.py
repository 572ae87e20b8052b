"""`make install && make demo` on a clean machine (`make test-install`; marked `deploy` and `install`).

Each run is a fresh container of the project's base image (TOPHAT_INSTALL_BASE: python:3.11-slim-bookworm, or
with CI=true the debootstrapped stand-in of `make base-image`) with Debian's make added, as a user's machine
has it: one with no C++ compiler at all, one with g++ and python3-dev (what Debian needs to build a C++
extension). Into it go the checkout's files as git knows them (`git ls-files`: tracked and new, not ignored, so
no .venv, build/ or imported checkpoint) and, read-only, the host's wheelhouse (`make wheelhouse`): pip installs
from it alone (PIP_NO_INDEX=1, TORCH_INDEX=), and the container has no network at all, so the install and the
demo touch nothing outside it. Then exactly what the README says, `make install` and `make demo`, must succeed;
without a compiler the native layers must be skipped in make native's one line, with g++ built and loaded; and
the demo's answer to its first question must name Paris.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from tophatctl.demo import CHAT_PROMPTS

pytestmark = [pytest.mark.deploy, pytest.mark.install]

REPO = Path(__file__).resolve().parents[2]
WHEELHOUSE = REPO / "build" / "wheelhouse"
BASE = os.environ.get("TOPHAT_INSTALL_BASE", "tophat-base:bookworm")
TIMEOUT_S = 1800  # a container's whole run; 2.5 to 5 minutes on 2 cores
QUESTION = CHAT_PROMPTS[0]
assert "capital of France" in QUESTION

# What runs in the container, after its files arrive on stdin: the compilers on PATH, the README's two commands,
# then whether the runner finds the native layers.
SCRIPT = """set -e
mkdir /src && tar -xf - -C /src && cd /src
echo "compilers on PATH: [$(command -v g++ c++ gcc cc | tr '\\n' ' ')]"
echo "== make install"
make install
echo "== make demo"
make demo
.venv/bin/python -c 'from shared.model.native_build import native_module as m; print("native module loaded:",bool(m()))'
"""


def image_for(name: str, packages: str) -> str:
    """The base image with make and `packages` from Debian (the build's own network; the layer is cached)."""
    tag = f"tophat-install:{name}"
    dockerfile = (
        f"FROM {BASE}\nLABEL org.tophat.project=tophat\n"
        "RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "
        f"make {packages} >/dev/null && apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin\n"
    )
    built = subprocess.run(
        ["docker", "build", "--quiet", "--network", "host", "--tag", tag, "-"],
        input=dockerfile,
        text=True,
        capture_output=True,
        timeout=900,
    )
    assert built.returncode == 0, f"docker build of {tag} failed:\n{built.stdout}\n{built.stderr}"
    return tag


def checkout_tar(path: Path) -> Path:
    """The files a clone of this checkout would have (tracked, and new ones not ignored), as a tar."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    with tarfile.open(path, "w") as tar:
        for name in sorted(set(listed)):
            if name and (REPO / name).is_file():  # not a tracked file deleted in the working tree
                tar.add(REPO / name, arcname=name, recursive=False)
    return path


def run_in_container(image: str, name: str, files: Path) -> tuple[int, str]:
    """SCRIPT in a fresh container with no network; its output streamed here as it comes, and returned."""
    container = f"tophat-install-{name}-{os.getpid()}"
    pip = ["-e", "PIP_NO_INDEX=1", "-e", "PIP_FIND_LINKS=/wheelhouse", "-e", "TORCH_INDEX="]
    volume = ["-v", f"{WHEELHOUSE}:/wheelhouse:ro"]
    command = ["docker", "run", "--rm", "-i", "--network", "none", "--name", container, *volume, *pip, image]
    lines = []
    with files.open("rb") as stdin:
        process = subprocess.Popen(
            [*command, "sh", "-c", SCRIPT], stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    timer = threading.Timer(TIMEOUT_S, subprocess.run, (["docker", "kill", container],), {"capture_output": True})
    timer.start()
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()
        status = process.wait()
    finally:
        timer.cancel()
        subprocess.run(["docker", "rm", "--force", container], capture_output=True)  # gone already unless interrupted
    return status, "".join(lines)


def demo_answer(output: str) -> str:
    """What the demo streamed back to its first question, up to the next one."""
    assert f">>> {QUESTION}" in output, "the demo did not ask its first question"
    return output.split(f">>> {QUESTION}", 1)[1].split("\n>>> ", 1)[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    assert (WHEELHOUSE / "tophat-0.1.0-py3-none-any.whl").is_file(), "make wheelhouse first (make test-install does)"
    return checkout_tar(tmp_path_factory.mktemp("checkout") / "checkout.tar")


@pytest.mark.parametrize("name, packages, compiler", [("no-compiler", "", False), ("gxx", "g++ python3-dev", True)])
def test_make_install_and_make_demo_in_a_clean_container(files, name, packages, compiler):
    image = image_for(name, packages)
    started = time.monotonic()
    status, output = run_in_container(image, name, files)
    took = time.monotonic() - started
    print(f"\n[{name}] make install && make demo in {image} ({BASE}): exit {status} in {took:.0f} s")
    assert status == 0, f"make install && make demo failed in {image}"

    found = output.split("compilers on PATH: [", 1)[1].split("]", 1)[0].split()
    install, demo = output.split("\n== make install\n", 1)[1].split("\n== make demo\n", 1)
    native = [line for line in install.splitlines() if line.startswith("native layers:")]
    assert len(native) == 1, native  # make native's one line, and nothing else said of it
    again = [line for line in demo.splitlines() if line.startswith("native layers:")]
    assert again == native, again  # make demo checks the install again: the same line, nothing new
    if compiler:
        assert "/usr/bin/g++" in found, found
        assert native[0].startswith("native layers: /src/build/native/"), native
        assert native[0].endswith("/tophat_native_layers.so"), native
        assert "native module loaded: True" in output
    else:
        assert found == [], f"the image has a compiler: {found}"
        assert native[0].startswith("native layers: skipped, no C++ compiler (c++ is not on PATH"), native
        assert "native module loaded: False" in output

    assert "Paris" in demo_answer(demo)
    assert "mesh stopped" in demo
