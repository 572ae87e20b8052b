"""`python -m tophatctl.healthcheck [URL] [--port-file PATH]`: a container healthcheck (exit 0 = healthy).

Images carry no curl; this asks one service's URL with the standard library: /readyz
where a healthy container gates others' start (Compose's depends_on), /healthz where a
failed check kills the container (Swarm: readiness is for routing, not for killing).
The URL defaults to $HEALTHCHECK_URL, else http://127.0.0.1:8000/readyz. A device
agent that took any free port (replicas sharing a host's network) writes its port
to a file, and `--port-file` reads it: the URL's port is replaced by it. An https URL
is asked without checking the certificate: the check runs on the container's own
loopback, where who answers is not in doubt, and the certificate names the service.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/readyz"


def health_url(url: str, port_file: str | None) -> str:
    if not port_file:
        return url
    with open(port_file, encoding="ascii") as handle:
        port = int(handle.read().strip())
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.hostname}:{port}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", default=os.environ.get("HEALTHCHECK_URL") or DEFAULT_URL)
    parser.add_argument("--port-file", default=None)
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    try:
        url = health_url(args.url, args.port_file)
        context = ssl._create_unverified_context() if url.startswith("https:") else None  # loopback: see above
        with urllib.request.urlopen(url, timeout=args.timeout, context=context) as response:  # noqa: S310
            return 0 if response.status == 200 else 1
    except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
        sys.stderr.write(f"unhealthy: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
