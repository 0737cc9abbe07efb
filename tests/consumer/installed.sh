#!/bin/sh
# The installed package, moved after installation, used by tests/consumer through
# find_package, with torch found from Torch_DIR alone:
#   installed.sh <cmake> <build tree> <work folder> <torch folder> <stub> <c++> [flags]
set -eu
cmake=$1 build=$2 work=$3 torch=$4 stub=$5 cxx=$6 flags=${7:-}
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work/installed" "$work/moved"
"$cmake" --install "$build" --prefix "$work/installed" >/dev/null
mv "$work/installed" "$work/moved"
prefix=$work/moved

# Relocatable: nothing in the package names this machine's torch, the build tree or the
# private header-only dependencies.
if grep -rlE "$torch|$build|fmt::|nlohmann" "$prefix/lib/cmake/neml2_dispatch"; then
  echo "the installed package names a path or a private dependency (files above)"; exit 1
fi
test -f "$prefix/include/neml2/version.hpp"
if [ -e "$build/apps" ]; then # the neml2-dispatch program, where it is built
  test -x "$prefix/bin/neml2-dispatch"
  "$prefix/bin/neml2-dispatch" --help >/dev/null
  echo "installed program runs"
fi

"$cmake" -S "$here" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$prefix" \
  -DTorch_DIR="$torch/share/cmake/Torch" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_CXX_FLAGS="$flags" >/dev/null
"$cmake" --build "$work/consumer"
"$work/consumer/consumer" "$stub"
