#!/usr/bin/env bash
# A stand-in for python:3.11-slim where no container registry is reachable: a Debian bookworm root
# filesystem (debootstrap's minbase) with Python 3.11, its venv and its headers (as python:3.11-slim has), imported with `docker import`.
# Prints the image's ID, for `docker build --build-arg BASE=ID` (docker/README.md).  Needs root,
# debootstrap, a Docker engine and a Debian mirror; an image already tagged TAG is reused.
#
#   docker/debootstrap-base.sh [TAG]            # TAG: ulfmtrain-base:bookworm
#   DEBIAN_MIRROR=http://mirror/debian docker/debootstrap-base.sh
set -euo pipefail
TAG=${1:-ulfmtrain-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if id=$(docker image inspect --format '{{.Id}}' "$TAG" 2>/dev/null); then
    echo "$id"
    exit 0
fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,python3.11-dev,ca-certificates bookworm "$root" "$MIRROR" >&2
# The sources python:3.11-slim's Debian has: security updates too, for the apt-get of the Dockerfile.
cat > "$root/etc/apt/sources.list" <<SOURCES
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
SOURCES
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/*.log
tar -C "$root" --numeric-owner -c . \
    | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$TAG" >&2
docker image inspect --format '{{.Id}}' "$TAG"
