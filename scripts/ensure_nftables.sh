#!/bin/sh
# Makes `nft` available on PATH (the Debian/Ubuntu package), as the network test bed's blackholes
# and one-way blocks need on a fresh machine. Does nothing when it is already there. Prints its path.
set -eu
if ! command -v nft >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q --no-install-recommends nftables \
        || { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends nftables; }
fi
command -v nft
