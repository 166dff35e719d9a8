#!/usr/bin/env bash
# A private Docker Engine for CI and for tests/test_docker.py, with no container registry.
#
#   scripts/docker_ci.sh up     install Docker Engine from Debian's packages when missing, start a
#                               private dockerd, make the base image; prints the env to use
#   scripts/docker_ci.sh env    print that env (exit 1 when the daemon is not running)
#   scripts/docker_ci.sh down   remove its containers and dangling images, stop the dockerd by its
#                               PID, unmount leftovers (EXEC_ROOT/netns/default, overlays)
#
# Everything lives under ${HEALTH_SIDECAR_CACHE:-$HOME/.cache/health-sidecar}/docker, like the
# engines of scripts/prepare_engines.sh: the data root (images and build cache survive between
# runs), the exec root, the socket docker.sock, dockerd.pid, dockerd.log, and docker.env (written
# by `up`, removed by `down`), which the tests read.
#
# Networking: loopback only. dockerd runs with --bridge=none --iptables=false (no bridge network
# is ever created: `docker network ls` shows host and none), and every build and container uses
# --network host.
#
# No image can be pulled, so the base image is made here: debootstrap --variant=minbase bookworm
# with Python 3 (and python-is-python3: the Dockerfile runs `python`), the host's extra CA
# certificates (the package index is reached through a proxy that needs them), docs and apt lists
# trimmed, then `docker import` as local/debian-python:<hash of its recipe>. It is made once per
# recipe: when the tagged image is in the cached data root, debootstrap is skipped.
#
# Needs root (dockerd, debootstrap). Knobs: HEALTH_SIDECAR_CACHE, DEBIAN_MIRROR (default: the
# bookworm URI in the host's apt sources).

set -euo pipefail

SUITE=bookworm
BASE_PACKAGES=python3,python3-venv,python3-pip,python-is-python3,ca-certificates
BASE_REPO=local/debian-python
IMAGE_ENV=(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8)
APT_PACKAGES=(docker.io containerd runc debootstrap)

CACHE=${HEALTH_SIDECAR_CACHE:-$HOME/.cache/health-sidecar}
D=$CACHE/docker
DATA_ROOT=$D/data
EXEC_ROOT=$D/exec
SOCK=$D/docker.sock
PIDFILE=$D/dockerd.pid
LOGFILE=$D/dockerd.log
ENV_FILE=$D/docker.env
DOCKER=/usr/bin/docker # Debian's CLI, the daemon's own version (its BuildKit builder works)
export DOCKER_HOST=unix://$SOCK

now_ms() {
    local us=${EPOCHREALTIME//[.,]/}
    echo $((us / 1000))
}
T0_MS=$(now_ms)
log() {
    local ms=$(($(now_ms) - T0_MS))
    printf '[docker-ci %4d.%ds] %s\n' $((ms / 1000)) $((ms % 1000 / 100)) "$*" >&2
}
die() {
    log "ERROR: $*"
    exit 1
}

usage() {
    sed -n '2,/^$/{s/^# \{0,1\}//;p}' "$0"
}

# --- install --------------------------------------------------------------------------------
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

install_packages() {
    local missing=() p
    for p in "${APT_PACKAGES[@]}"; do
        installed "$p" || missing+=("$p")
    done
    if ((${#missing[@]} == 0)); then
        log "packages present: ${APT_PACKAGES[*]}"
        return
    fi
    log "apt-get install ${missing[*]}"
    # No service may start from the package scripts (a system dockerd would make a bridge).
    local made_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        made_policy=1
    fi
    local rc=0
    {
        DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                "${missing[@]}"
    } >"$D/apt.log" 2>&1 || rc=$?
    ((made_policy)) && rm -f /usr/sbin/policy-rc.d
    if ((rc)); then
        tail -n 30 "$D/apt.log" >&2
        die "apt-get install failed (log: $D/apt.log)"
    fi
    log "installed: $("$DOCKER" --version)"
}

# --- daemon -----------------------------------------------------------------------------------
daemon_pid() { # the PID of our dockerd when it runs
    local pid
    [[ -f $PIDFILE ]] || return 1
    pid=$(<"$PIDFILE")
    [[ -n $pid && -d /proc/$pid ]] || return 1
    [[ $(readlink "/proc/$pid/exe" 2>/dev/null) == */dockerd ]] || return 1
    echo "$pid"
}

daemon_answers() { "$DOCKER" version --format '{{.Server.Version}}' >/dev/null 2>&1; }

start_daemon() {
    if daemon_pid >/dev/null && daemon_answers; then
        log "dockerd already running (pid $(daemon_pid)) on $SOCK"
        return
    fi
    if [[ -e /run/containerd/containerd.sock ]]; then
        log "note: a system containerd answers at /run/containerd/containerd.sock; dockerd uses it"
    fi
    unmount_leftovers # of a daemon that died without `down`
    mkdir -p "$DATA_ROOT" "$EXEC_ROOT"
    [[ -f $D/daemon.json ]] || echo '{}' >"$D/daemon.json"
    rm -f "$SOCK" "$PIDFILE"
    log "starting dockerd (data root $DATA_ROOT; log $LOGFILE)"
    setsid dockerd \
        --config-file="$D/daemon.json" \
        -H "unix://$SOCK" \
        --pidfile="$PIDFILE" \
        --data-root="$DATA_ROOT" \
        --exec-root="$EXEC_ROOT" \
        --bridge=none --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false \
        --storage-driver=overlay2 \
        </dev/null >>"$LOGFILE" 2>&1 9>&- & # 9>&-: the daemon must not hold our lock
    local deadline=$((SECONDS + 30))
    until daemon_answers; do
        if ((SECONDS > deadline)); then
            tail -n 30 "$LOGFILE" >&2
            die "dockerd did not answer on $SOCK within 30 s"
        fi
        sleep 0.2
    done
    log "dockerd $("$DOCKER" version --format '{{.Server.Version}}') up (pid $(daemon_pid))"
    local networks
    networks=$("$DOCKER" network ls --format '{{.Driver}}' | sort | tr '\n' ' ')
    [[ $networks == "host null " ]] || die "unexpected docker networks: $networks"
}

# --- base image -------------------------------------------------------------------------------
host_mirror() { # the bookworm URI of the host's apt sources
    local uri
    uri=$(awk '/^URIs:/ {u=$2} /^Suites:/ && / '"$SUITE"'( |$)/ {print u; exit}' \
        /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
    if [[ -z $uri ]]; then
        uri=$(awk '$1=="deb" && $3=="'"$SUITE"'" {print $2; exit}' \
            /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

# The recipe of the base image; its text is part of the image's key.
make_rootfs() { # ROOTFS MIRROR
    local rootfs=$1 mirror=$2
    debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$rootfs" "$mirror" \
        >>"$D/debootstrap.log" 2>&1
    if compgen -G '/usr/local/share/ca-certificates/*' >/dev/null; then
        cp -a /usr/local/share/ca-certificates/. "$rootfs/usr/local/share/ca-certificates/"
    fi
    chroot "$rootfs" update-ca-certificates >>"$D/debootstrap.log" 2>&1
    rm -rf "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
        "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/log/*.log "$rootfs"/tmp/*
}

base_key() {
    {
        declare -f make_rootfs
        echo "$SUITE $BASE_PACKAGES $(host_mirror) ${IMAGE_ENV[*]}"
        cat /usr/local/share/ca-certificates/* 2>/dev/null || true
    } | sha256sum | cut -c1-12
}

make_base_image() {
    local image key
    key=$(base_key)
    image=$BASE_REPO:$key
    BASE_IMAGE=$image
    if "$DOCKER" image inspect "$image" >/dev/null 2>&1; then
        log "base image present: $image"
        return
    fi
    local mirror rootfs changes=() e
    mirror=$(host_mirror)
    rootfs=$(mktemp -d "$D/.rootfs.XXXXXX")
    # shellcheck disable=SC2064
    trap "rm -rf -- '$rootfs'" EXIT
    log "debootstrap $SUITE (minbase + $BASE_PACKAGES) from $mirror (~70 s; log $D/debootstrap.log)"
    : >"$D/debootstrap.log"
    make_rootfs "$rootfs" "$mirror" || {
        tail -n 30 "$D/debootstrap.log" >&2
        die "debootstrap failed (log: $D/debootstrap.log)"
    }
    for e in "${IMAGE_ENV[@]}"; do
        changes+=(--change "ENV $e")
    done
    log "docker import -> $image"
    tar --numeric-owner -C "$rootfs" -c . | "$DOCKER" import "${changes[@]}" - "$image" >/dev/null
    rm -rf -- "$rootfs"
    trap - EXIT
    # Base images of older recipes are dead weight.
    local old
    for old in $("$DOCKER" image ls "$BASE_REPO" --format '{{.Repository}}:{{.Tag}}'); do
        [[ $old == "$image" ]] || "$DOCKER" image rm "$old" >/dev/null 2>&1 || true
    done
    log "base image made: $image ($("$DOCKER" image inspect -f '{{.Size}}' "$image") bytes)"
}

write_env() {
    local tmp=$ENV_FILE.tmp.$$
    {
        echo "# Written by scripts/docker_ci.sh up; removed by scripts/docker_ci.sh down."
        echo "DOCKER_HOST=unix://$SOCK"
        echo "HEALTH_SIDECAR_DOCKER=$DOCKER"
        echo "HEALTH_SIDECAR_BASE_IMAGE=$BASE_IMAGE"
    } >"$tmp"
    mv -f -- "$tmp" "$ENV_FILE"
}

print_env() {
    [[ -f $ENV_FILE ]] && daemon_pid >/dev/null && daemon_answers || {
        log "no private dockerd running; run: scripts/docker_ci.sh up"
        return 1
    }
    grep -v '^#' "$ENV_FILE" | sed 's/^/export /'
}

# --- down -------------------------------------------------------------------------------------
unmount_leftovers() {
    local m
    # Deepest first: netns files, overlay mounts, shm, anything left under our folder.
    while read -r m; do
        umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "could not unmount $m"
    done < <(awk -v d="$D/" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r)
}

stop_daemon() {
    local pid
    rm -f "$ENV_FILE"
    if ! pid=$(daemon_pid); then
        log "no dockerd running from $PIDFILE"
        unmount_leftovers
        return
    fi
    if daemon_answers; then
        local ids
        ids=$("$DOCKER" ps -aq)
        [[ -z $ids ]] || "$DOCKER" rm -f $ids >/dev/null 2>&1 || true
        # Keep the cache bounded: images a rebuild replaced, and old build cache.
        "$DOCKER" image prune -f >/dev/null 2>&1 || true
        "$DOCKER" builder prune -f --keep-storage 1gb >/dev/null 2>&1 || true
    fi
    log "stopping dockerd (pid $pid)"
    kill -TERM "$pid"
    local deadline=$((SECONDS + 30))
    while [[ -d /proc/$pid ]]; do
        if ((SECONDS > deadline)); then
            log "dockerd still running after 30 s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            sleep 0.5
            break
        fi
        sleep 0.2
    done
    unmount_leftovers
    rm -f "$SOCK" "$PIDFILE"
    log "dockerd stopped"
}

main() {
    local cmd=${1:-}
    case $cmd in
    up | down | env) ;;
    -h | --help | help) usage && return 0 ;;
    *) usage >&2 && die "unknown command '${cmd}'" ;;
    esac
    ((EUID == 0)) || die "needs root (dockerd, debootstrap)"
    mkdir -p "$D"
    exec 9>"$D/.lock"
    flock 9 || die "cannot lock $D/.lock"
    case $cmd in
    up)
        install_packages
        start_daemon
        make_base_image
        write_env
        log "ready in $(((($(now_ms) - T0_MS)) / 1000)) s; env ($ENV_FILE):"
        print_env
        ;;
    env) print_env ;;
    down) stop_daemon ;;
    esac
}

main "$@"
