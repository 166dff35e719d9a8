# shellcheck shell=bash
# Source this file to export the engine paths written by scripts/prepare_engines.sh:
#   . scripts/engines.env.sh && "$LLAMA_SERVER_BIN" --version
# Exports LLAMA_SERVER_BIN, TINY_GGUF, BIG_GGUF, DYNAMO_PYTHON and DYNAMO_MODEL_DIR
# (only those that were prepared). Returns 1 when the cache has no engines.env yet.

_hs_env_file="${HEALTH_SIDECAR_CACHE:-$HOME/.cache/health-sidecar}/engines.env"
if [[ -r $_hs_env_file ]]; then
    set -a
    # shellcheck source=/dev/null
    . "$_hs_env_file"
    set +a
    unset _hs_env_file
else
    echo "engines.env.sh: $_hs_env_file not found; run scripts/prepare_engines.sh" >&2
    unset _hs_env_file
    return 1
fi
