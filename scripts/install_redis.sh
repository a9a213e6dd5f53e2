#!/usr/bin/env bash
# Install redis-server (the shared KV level's tests start their own on a free loopback port) where
# it is missing: Debian's package, as root, when apt-get is there; otherwise say the command.
# A no-op when redis-server is already on PATH.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi
if [[ "$(id -u)" == "0" ]] && command -v apt-get >/dev/null 2>&1; then
    echo "install_redis: installing Debian's redis-server" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends redis-server >/dev/null \
        || { apt-get update -qq >/dev/null && apt-get install -y --no-install-recommends \
             redis-server >/dev/null; }
    # the tests run their own servers: the packaged service is not needed
    (service redis-server stop >/dev/null 2>&1 || true)
    exit 0
fi
echo "install_redis: redis-server is missing; install it (apt-get install redis-server) or the" \
     "shared-level tests skip" >&2
