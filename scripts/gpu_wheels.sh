#!/usr/bin/env bash
# Refreshes benchmarks/gpu/wheels/ from the lock: the wheels of commfuse's pure-Python dependencies
# that the lent GPU machine's image lacks (Python 3.12, nothing installable there), at exactly the
# versions .ci/lock.txt pins, so the GPU run and the development install use one pydantic.
# Run it after `bash scripts/lock.sh` changes any of them (tests/test_gpu_mode.py checks the match).
#
# Usage: bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dest=benchmarks/gpu/wheels
# The distributions behind benchmarks/gpu/wheels.py's REQUIRED modules.
packages=(pydantic pydantic_core annotated-types typing-inspection typing_extensions)
pins=()
for p in "${packages[@]}"; do
  # Lock names may differ from these in case and in '-' vs '_' (PEP 503 normalisation).
  want="$(echo "$p" | tr 'A-Z_' 'a-z-')"
  line="$(grep -v '^#' .ci/lock.txt | awk -F'==' -v w="$want" '{n=tolower($1); gsub("_","-",n)} n==w')"
  [ -n "$line" ] || { echo "$p is not in .ci/lock.txt" >&2; exit 1; }
  pins+=("$line")
done
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python -m pip download -q --no-deps --only-binary=:all: -d "$tmp" \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "${pins[@]}"
rm -f "$dest"/*.whl
mv "$tmp"/*.whl "$dest"/
ls -l "$dest"
