#!/bin/sh
# The image's entrypoint: `gateway [flags]` runs kiln-gateway, `worker [flags]` runs kiln-worker,
# anything else runs as given (`kiln orgs create ...`, `sh`). The daemon replaces this shell
# (exec), so it is PID 1 and gets the container's SIGTERM itself.
#
# Secrets as files (Docker/Compose secrets, Kubernetes Secret volumes): the worker secret and the
# admin token have their own *_FILE settings in Kiln; for the settings below, which Kiln reads
# only from a flag or the environment, KILN_<NAME>_FILE names a file whose content becomes
# KILN_<NAME>, so the value never appears in the image, `docker inspect` or `ps`.
set -eu

for name in KILN_DATABASE_URL KILN_REDIS_URL KILN_SECRET_KEY; do
  eval "file=\${${name}_FILE:-}"
  [ -n "$file" ] || continue
  if eval "[ -n \"\${${name}:-}\" ]"; then
    echo "kiln entrypoint: set ${name} or ${name}_FILE, not both" >&2
    exit 2
  fi
  if [ ! -r "$file" ]; then
    echo "kiln entrypoint: ${name}_FILE: cannot read ${file}" >&2
    exit 2
  fi
  value=$(cat "$file")
  export "${name}=${value}"
  unset "${name}_FILE"
done

case "${1:-}" in
  gateway) shift; exec kiln-gateway "$@" ;;
  worker) shift; exec kiln-worker "$@" ;;
  "") echo "usage: gateway [kiln-gateway flags] | worker [kiln-worker flags] | COMMAND..." >&2; exit 2 ;;
  *) exec "$@" ;;
esac
