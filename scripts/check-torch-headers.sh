#!/usr/bin/env bash
# Compiles (syntax only) the library, tests and benchmarks against another torch's
# headers, e.g. `scripts/check-torch-headers.sh 2.11.0` (the GPU machine's torch).
# Downloads that wheel once into the cache (about 1 GB).
set -euo pipefail
version="${1:?usage: check-torch-headers.sh TORCH_VERSION}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
dir="$NEML2_DISPATCH_CACHE/torch-headers-$version"
if [ ! -d "$dir/torch/include" ]; then
  mkdir -p "$dir"
  pip download -q --no-deps "torch==$version" -d "$dir"
  unzip -q -o "$dir"/torch-*.whl 'torch/include/*' -d "$dir"
  rm -f "$dir"/torch-*.whl
fi
T="$dir/torch"
for f in "$root"/src/*.cpp "$root"/tests/test_*.cpp "$root"/bench/bench_sync_chunking.cpp \
         "$root"/examples/*.cpp; do
  g++ -std=c++20 -fsyntax-only -DFMT_HEADER_ONLY -D_GLIBCXX_USE_CXX11_ABI=1 \
    -I"$root/include" -I"$root/tests/support" -DNEML2_DISPATCH_TEST_ARTIFACTS='"."' \
    -DNEML2_DISPATCH_TEST_SOURCES='"."' -DNEML2_DISPATCH_BENCH_ARTIFACTS='"."' \
    -isystem "$T/include" -isystem "$T/include/torch/csrc/api/include" "$f"
  echo "ok: ${f#$root/} against torch $version"
done
