#!/usr/bin/env bash
# Install Debian's `chromium` (headless screenshots and --dump-dom of the status page, for
# tests/test_status_page.py), only when it is missing. Idempotent: a no-op once chromium is on
# PATH. Needs root (or passwordless sudo) and Debian apt; installs no recommended packages.
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
    echo "prepare_chromium: $(chromium --version 2>/dev/null | head -n1)"
    exit 0
fi

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || {
        echo "prepare_chromium: needs root or sudo to apt-get install chromium" >&2
        exit 2
    }
    SUDO=(sudo)
fi

export DEBIAN_FRONTEND=noninteractive
if ! "${SUDO[@]}" apt-get install -y --no-install-recommends chromium; then
    "${SUDO[@]}" apt-get update
    "${SUDO[@]}" apt-get install -y --no-install-recommends chromium
fi

command -v chromium >/dev/null 2>&1 || {
    echo "prepare_chromium: chromium still missing after installing it" >&2
    exit 1
}
echo "prepare_chromium: $(chromium --version 2>/dev/null | head -n1)"
