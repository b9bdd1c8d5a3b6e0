#!/bin/sh
# dualpath-entrypoint COMMAND [ARGS...]: the image's entrypoint (examples/deploy/Dockerfile).
#   1. Each file in $DUALPATH_SECRETS_DIR (default /run/secrets) becomes an environment variable named
#      after it in upper case (aws_secret_access_key -> AWS_SECRET_ACCESS_KEY), unless already set:
#      secrets never sit in a compose file, an image or a command line.
#   2. With DUALPATH_KV_CONFIG (an engine: the path of its --kv-transfer-config JSON), `dualpath-kv doctor`
#      checks it first (DUALPATH_DOCTOR=0 skips that) and the JSON is appended as --kv-transfer-config.
#   3. DUALPATH_MMA=1 runs the command under mma-run (libmma_preload.so preloaded).
#   Before 2, DUALPATH_CONFIG_PATCH (a JSON merge patch, RFC 7396) is applied to the service's config file:
#   the engine's $DUALPATH_KV_CONFIG, or the file after --config (router, gateway). One mounted file serves
#   every container; what differs per container (its host name, the store's address) comes from the patch.
set -eu
secrets_dir=${DUALPATH_SECRETS_DIR:-/run/secrets}
if [ -d "$secrets_dir" ]; then
  for file in "$secrets_dir"/*; do
    [ -f "$file" ] || continue
    name=$(basename "$file" | tr '[:lower:]-' '[:upper:]_')
    case "$name" in *[!A-Z0-9_]*|[0-9]*) echo "dualpath-entrypoint: skipping $file (not a variable name)" >&2; continue ;; esac
    if [ -z "$(printenv "$name" || true)" ]; then
      export "$name=$(cat "$file")"
    fi
  done
fi
if [ "$#" -eq 0 ]; then
  echo "usage: dualpath-entrypoint COMMAND [ARGS...]" >&2
  exit 2
fi
if [ -n "${DUALPATH_CONFIG_PATCH:-}" ]; then
  patched=$(mktemp -d)
  if [ -n "${DUALPATH_KV_CONFIG:-}" ]; then
    dualpath-kv patch-config "$DUALPATH_KV_CONFIG" > "$patched/$(basename "$DUALPATH_KV_CONFIG")"
    DUALPATH_KV_CONFIG=$patched/$(basename "$DUALPATH_KV_CONFIG")
  else
    after_config=0
    for arg do  # rebuilds "$@", the file after --config replaced by its patched copy
      shift
      if [ "$after_config" = 1 ]; then
        dualpath-kv patch-config "$arg" > "$patched/$(basename "$arg")"
        arg=$patched/$(basename "$arg")
      fi
      [ "$arg" = --config ] && after_config=1 || after_config=0
      set -- "$@" "$arg"
    done
  fi
  if [ -z "$(ls "$patched")" ]; then
    echo "dualpath-entrypoint: DUALPATH_CONFIG_PATCH is set but no config file is named (DUALPATH_KV_CONFIG or --config FILE)" >&2
    exit 2
  fi
fi
if [ -n "${DUALPATH_KV_CONFIG:-}" ]; then
  if [ "${DUALPATH_DOCTOR:-1}" != 0 ]; then
    dualpath-kv doctor --config-file "$DUALPATH_KV_CONFIG"
  fi
  set -- "$@" --kv-transfer-config "$(cat "$DUALPATH_KV_CONFIG")"
fi
if [ "${DUALPATH_MMA:-0}" = 1 ]; then
  set -- mma-run "$@"
fi
exec "$@"
