#!/bin/sh
# Makes `redis-server` available on PATH (the Debian/Ubuntu package), as the Redis response store's
# tests need on a fresh machine. Does nothing when it is already there. Prints its path.
set -eu
if ! command -v redis-server >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q --no-install-recommends redis-server \
        || { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends redis-server; }
fi
command -v redis-server
