#!/bin/sh
# Usage: ensure_command.sh COMMAND [PACKAGE]
# Makes COMMAND available on PATH by installing the Debian/Ubuntu PACKAGE (default: COMMAND), as the
# tests that start real services (redis-server, haproxy, nft) need on a fresh machine. Does nothing
# when it is already there. Prints its path.
set -eu
command="$1"
package="${2:-$1}"
if ! command -v "$command" >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q --no-install-recommends "$package" \
        || { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends "$package"; }
fi
command -v "$command"
