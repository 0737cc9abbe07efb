#!/usr/bin/env bash
# Fills .carry/ (git-ignored) with what scripts/gpu-check.sh needs on the GPU machine,
# which has Python 3.12 and torch 2.11 but no network and no Debian -dev packages:
#   .carry/wheels/  neml2 and the Python packages neml2-compile imports, but torch
#   .carry/deps/    headers of fmt, nlohmann_json, doctest, CLI11, Google Benchmark; libbenchmark
# Usage: scripts/prepare-gpu-carry.sh [PYTHON_VERSION, default 3.12]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
python_version="${1:-3.12}"
carry="$root/.carry"
rm -rf "$carry"
mkdir -p "$carry/wheels" "$carry/deps/include" "$carry/deps/lib"

# What neml2-compile and the eager reference import, at the versions pinned here.
packages=(neml2 nmhit pyzag opt_einsum tqdm numpy)
for p in "${packages[@]}"; do
  "$NEML2_DISPATCH_VENV/bin/pip" show "$p" | awk -v p="$p" '/^Version:/ {print p "==" $2}'
done > "$carry/requirements.txt"
pip download -q --python-version "$python_version" --only-binary=:all: --no-deps \
  -r "$carry/requirements.txt" -d "$carry/wheels"

cp -r /usr/include/fmt /usr/include/nlohmann /usr/include/doctest /usr/include/CLI /usr/include/benchmark \
  "$carry/deps/include/"
cp -a /usr/lib/x86_64-linux-gnu/libbenchmark.so* "$carry/deps/lib/"
du -sh "$carry"
