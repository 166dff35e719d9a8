#!/usr/bin/env bash
# Install Debian's `prometheus` package (2.42 on bookworm: the server and promtool) for
# tests/test_alerts.py, only when promtool is missing. Idempotent: a no-op once promtool is on PATH.
#
# The package's postinst would start a system Prometheus listening on 0.0.0.0:9090. The tests
# start their own server on a free loopback port, so this script keeps the package's service from
# starting (a temporary /usr/sbin/policy-rc.d denying it, unless one is already in place), and
# if a service was started anyway, stops and disables it and kills what is left by its PID.
# Needs root (or passwordless sudo) and Debian apt.
set -euo pipefail

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
    echo "prepare_prometheus: $(promtool --version 2>&1 | head -n1)"
    exit 0
fi

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || {
        echo "prepare_prometheus: needs root or sudo to apt-get install prometheus" >&2
        exit 2
    }
    SUDO=(sudo)
fi

policy=/usr/sbin/policy-rc.d
own_policy=0
if [[ ! -e $policy ]]; then
    # invoke-rc.d consults this: exit 101 means "action forbidden", so postinst starts nothing.
    printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$policy" >/dev/null
    "${SUDO[@]}" chmod 755 "$policy"
    own_policy=1
fi
cleanup() { if ((own_policy)); then "${SUDO[@]}" rm -f "$policy"; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
if ! "${SUDO[@]}" apt-get install -y --no-install-recommends prometheus; then
    "${SUDO[@]}" apt-get update
    "${SUDO[@]}" apt-get install -y --no-install-recommends prometheus
fi

# If the package's service came up regardless (a host without a policy-rc.d honoured by its
# init system), stop and disable it, then kill the daemon by its PID.
# The package enables its unit even when the start was denied: disable it (works offline too) so
# it does not come up at the next boot either.
if command -v systemctl >/dev/null 2>&1; then
    if [[ -d /run/systemd/system ]]; then
        "${SUDO[@]}" systemctl disable --now prometheus.service >/dev/null 2>&1 || true
    else
        "${SUDO[@]}" systemctl disable prometheus.service >/dev/null 2>&1 || true
    fi
fi
if [[ ! -d /run/systemd/system && -x /etc/init.d/prometheus ]]; then
    "${SUDO[@]}" /etc/init.d/prometheus stop >/dev/null 2>&1 || true
fi
for pidfile in /run/prometheus/prometheus.pid /run/prometheus.pid /var/run/prometheus.pid; do
    if [[ -r $pidfile ]]; then
        pid=$(cat "$pidfile")
        if [[ $pid =~ ^[0-9]+$ ]] && [[ $(readlink "/proc/$pid/exe" 2>/dev/null) == */prometheus ]]; then
            echo "prepare_prometheus: killing the package's Prometheus (pid $pid)"
            "${SUDO[@]}" kill "$pid" || true
        fi
    fi
done
# Whatever still listens on :9090 as /usr/bin/prometheus is the package's daemon: end it by PID.
if command -v ss >/dev/null 2>&1; then
    for pid in $(ss -Hltnp 'sport = :9090' 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u); do
        if [[ $(readlink "/proc/$pid/exe" 2>/dev/null) == /usr/bin/prometheus ]]; then
            echo "prepare_prometheus: killing the package's Prometheus on :9090 (pid $pid)"
            "${SUDO[@]}" kill "$pid" || true
        fi
    done
fi

command -v promtool >/dev/null 2>&1 || {
    echo "prepare_prometheus: promtool still missing after installing prometheus" >&2
    exit 1
}
echo "prepare_prometheus: $(promtool --version 2>&1 | head -n1)"
