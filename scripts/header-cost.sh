#!/usr/bin/env bash
# What including each public header costs a translation unit: user+sys CPU seconds and
# peak RSS of g++ compiling a one-line file `#include <HEADER>` with the project's flags
# (-std=c++20 -O3), beside ATen's own headers in the same run; the least of RUNS
# compilations each (default 3: on a loaded machine the least is the one least disturbed).
# Exits non-zero when <neml2/dispatch.hpp> costs more than 1.10x <ATen/ATen.h> (which a file
# that makes tensors needs anyway), or <neml2/any_dispatched_model.hpp> (what a file that
# holds and calls models without ATen includes; <neml2/dispatch_fwd.hpp> is part of it) more
# than 1.15x <ATen/core/Tensor.h>.
#   scripts/header-cost.sh      RUNS=1 scripts/header-cost.sh   (quicker)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh" >/dev/null
torch="$("$NEML2_DISPATCH_VENV/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
# neml2/version.hpp is generated into the build folder's include/ by the configure step.
build="${NEML2_DISPATCH_BUILD:-$root/build}"
[ -f "$build/include/neml2/version.hpp" ] || {
  echo "header-cost: $build/include/neml2/version.hpp is missing; build first (scripts/build.sh)" >&2
  exit 2
}
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
headers=(ATen/ATen.h ATen/core/Tensor.h)
for h in "$root"/include/neml2/*.hpp "$root"/include/neml2/policies/*.hpp \
         "$root"/include/neml2/detail/*.hpp; do
  headers+=("${h#$root/include/}")
done
printf '%-42s %8s %8s\n' header "CPU s" "peak MB"
for h in "${headers[@]}"; do
  echo "#include <$h>" >"$work/one.cpp"
  seconds=""
  for ((run = 0; run < ${RUNS:-3}; ++run)); do
    /usr/bin/time -f '%U %S %M' -o "$work/time" \
      g++ -std=c++20 -O3 -DNDEBUG -D_GLIBCXX_USE_CXX11_ABI=1 -I"$root/include" -I"$build/include" \
      -isystem "$torch/include" -isystem "$torch/include/torch/csrc/api/include" \
      -c "$work/one.cpp" -o "$work/one.o"
    read -r user sys rss <"$work/time"
    this="$(echo "$user + $sys" | bc)"
    if [ -z "$seconds" ] || (($(echo "$this < $seconds" | bc))); then seconds="$this"; fi
  done
  printf '%-42s %8.2f %8.0f\n' "$h" "$seconds" "$((rss / 1024))"
  case "$h" in
  ATen/ATen.h) aten="$seconds" ;;
  ATen/core/Tensor.h) tensor="$seconds" ;;
  neml2/dispatch.hpp) dispatch="$seconds" ;;
  neml2/any_dispatched_model.hpp) light="$seconds" ;;
  esac
done
ratio() { echo "scale=3; $1 / $2" | bc; }
echo "dispatch.hpp / ATen/ATen.h: $(ratio "$dispatch" "$aten") (at most 1.10)"
echo "any_dispatched_model.hpp / ATen/core/Tensor.h: $(ratio "$light" "$tensor") (at most 1.15)"
if (($(echo "$dispatch > 1.10 * $aten" | bc))) || (($(echo "$light > 1.15 * $tensor" | bc))); then
  echo "header-cost: a limit is exceeded" >&2
  exit 1
fi
