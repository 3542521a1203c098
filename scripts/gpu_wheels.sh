#!/usr/bin/env bash
# Install the optional GPU packages that travel with the tree as wheels (no registry is reachable on the GPU
# machine) into a scratch site directory, and print the PYTHONPATH that makes them importable.
#
#   .whl2/   NAME.whl.part.aa: the first part of a wheel split in two (`split -b 46000000 NAME.whl NAME.whl.part.`)
#            because one call carries at most 64 MiB (nvidia-cutlass-dsl-libs-cu13 is ~92 MB)
#            and any whole wheels that fit beside it
#   .whl/    the other wheels, and NAME.whl.part.ab
#
# Usage on the GPU machine:
#   bash scripts/gpu_wheels.sh stage      # call 1: copy .whl2/* to /tmp/wheel_parts
#   eval "$(bash scripts/gpu_wheels.sh install)"   # call 2: join the parts, install, export PYTHONPATH
set -euo pipefail
site=/tmp/site
parts=/tmp/wheel_parts
case "${1:-}" in
  stage)
    mkdir -p "$parts"
    cp .whl2/* "$parts"/
    echo "staged: $(ls "$parts")" >&2
    ;;
  install)
    mkdir -p "$parts" "$site"
    cp .whl/*.part.* "$parts"/ 2>/dev/null || true
    for first in "$parts"/*.part.aa; do
      [ -e "$first" ] || continue
      wheel=${first%.part.aa}
      cat "$wheel".part.* > "$wheel"
      echo "joined $(basename "$wheel")" >&2
    done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      .whl/*.whl "$parts"/*.whl >&2
    echo "export PYTHONPATH=$site:$site/nvidia_cutlass_dsl/dsl_packages:$PWD\${PYTHONPATH:+:\$PYTHONPATH}"
    ;;
  *)
    echo "usage: $0 stage|install" >&2
    exit 2
    ;;
esac
