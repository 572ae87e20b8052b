#!/usr/bin/env bash
# A local stand-in for python:3.11-slim-bookworm where no image registry is reachable:
# debootstrap a minimal Debian bookworm with its Python 3.11 and import it as an image.
# The machine's extra CA certificates go in too, so pip and apt inside builds trust the
# package proxy. Usage: .ci/base-image.sh [IMAGE]   (default tophat-base:bookworm)
set -euo pipefail
image="${1:-tophat-base:bookworm}"
if docker image inspect "$image" >/dev/null 2>&1; then
    echo "base image $image exists"
    exit 0
fi
root="$(mktemp -d /tmp/tophat-rootfs.XXXXXX)"
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" \
    http://deb.debian.org/debian >"$root.log" 2>&1 || { tail -20 "$root.log"; exit 1; }
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null
fi
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
tar -C "$root" -c . | docker import --change 'CMD ["python3"]' - "$image" >/dev/null
rm -f "$root.log"
echo "imported $image"
