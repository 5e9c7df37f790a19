#!/usr/bin/env bash
# Renew docker/constraints.txt: build the Dockerfile's build stage unpinned (PIN=no: the newest versions
# that pyproject.toml allows), then write what it installed, every package at its version.  The image's
# build checks that it installs exactly these.  Arguments go to docker build (e.g. --build-arg BASE=...).
#
#   docker/pin.sh [DOCKER-BUILD-ARGUMENTS...]
set -euo pipefail
cd "$(dirname "$0")/.."
docker build -f docker/Dockerfile --target build --build-arg PIN=no -t ulfmtrain:resolve "$@" . >&2
{
    echo "# Every package the image installs, at the version one resolved install chose: renew with docker/pin.sh."
    docker run --rm ulfmtrain:resolve /opt/venv/bin/pip freeze --all --exclude ulfmtrain
} > docker/constraints.txt.new
mv docker/constraints.txt.new docker/constraints.txt
docker rmi ulfmtrain:resolve > /dev/null
