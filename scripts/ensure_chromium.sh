#!/bin/sh
# Makes the `chromium` browser available on PATH (the Debian/Ubuntu package), as the dashboard's
# browser tests need on a fresh machine; Playwright drives it through `executable_path`, never a
# browser build of its own. Does nothing when it is already there. Prints its path.
set -eu
if ! command -v chromium >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q --no-install-recommends chromium \
        || { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends chromium; }
fi
command -v chromium
