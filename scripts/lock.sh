#!/usr/bin/env bash
# Writes .ci/lock.txt: every package the development install resolves, pinned.
#
# The lock is made the way a new user installs (the README's two lines) in a brand-new virtualenv,
# with nothing but pyproject.toml's ranges to steer the resolver, then read back with `pip freeze`.
# torch is pinned as the README installs it (2.13.0, without the wheel's local "+cpu" tag, which
# `==2.13.0` matches). Platform: Linux x86_64, CPython 3.11 — the project's and CI's machines.
# After changing the lock, refresh the GPU wheels from it: `bash scripts/gpu_wheels.sh`.
#
# Usage: bash scripts/lock.sh [PYTHON]      (default: python3.11, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-$(command -v python3.11 || command -v python3)}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$py" -m venv "$work/venv"
# shellcheck disable=SC1091
source "$work/venv/bin/activate"
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[test,bench,conformance]'
{
  echo "# The development install's lock: \`pip install -e '.[test,bench,conformance]' -c .ci/lock.txt\`"
  echo "# after \`pip install torch==2.13.0\` (README, \"Tests\"). Every package it resolves, pinned."
  echo "# Platform: Linux $(uname -m), CPython $(python -c 'import sys; print("%d.%d" % sys.version_info[:2])'); made $(date -u +%F) by"
  echo "# \`bash scripts/lock.sh\` (docs/contributing.md, \"The lock\"). Do not edit by hand."
  python -m pip freeze --exclude-editable | grep -v '^#' | grep -iv '^commfuse[= @]' \
    | sed -E 's/^(torch==[^+]+)\+.*/\1/' | LC_ALL=C sort -f
} > .ci/lock.txt.new
mv .ci/lock.txt.new .ci/lock.txt
echo "wrote .ci/lock.txt ($(grep -vc '^#' .ci/lock.txt) packages)"
