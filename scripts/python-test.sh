#!/usr/bin/env bash
# The Python side as a user gets it: builds the wheel (python/, scikit-build-core, without
# build isolation, against the project environment's torch), installs it into a scratch
# environment that sees the project environment's packages (torch, neml2, pytest), runs
# every Python suite against the installed module, and builds and runs tests/consumer
# against the C++ package inside the wheel (the prefix `python -m neml2_dispatch
# --cmake-prefix` prints). Extra arguments go to pytest.
#
# The suites load the main build's models (build/artifacts, made by scripts/test.sh; the
# artifacts target is built here when missing), and the wheel links the main build's
# compiled library, tools and program (built here when missing). NEML2_DISPATCH_PYTHON_WORK (default
# build-wheel/) keeps the wheel's CMake tree between runs, so a second run recompiles
# only what changed. NEML2_DISPATCH_BUILD_LOCK: a file to flock around each build step.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
start=$SECONDS
source "$root/scripts/setup.sh"
python="$NEML2_DISPATCH_VENV/bin/python"
build="${NEML2_DISPATCH_BUILD:-$root/build}"
work="${NEML2_DISPATCH_PYTHON_WORK:-$root/build-wheel}"
lock=()
[ -z "${NEML2_DISPATCH_BUILD_LOCK:-}" ] || lock=(flock "$NEML2_DISPATCH_BUILD_LOCK")
step() { echo "=== python-test: $* ($((SECONDS - start)) s)"; }

step "the models the suites load ($build/artifacts), the library and the program"
if [ -f "$build/CMakeCache.txt" ]; then
  "${lock[@]}" cmake --build "$build" --target neml2_dispatch_artifacts neml2_dispatch_program \
    -j "$(nproc)" >/dev/null
else
  NEML2_DISPATCH_BUILD="$build" NEML2_DISPATCH_TARGETS="neml2_dispatch_artifacts neml2_dispatch_program" \
    "${lock[@]}" "$root/scripts/build.sh"
fi

# The wheel as a user's pip builds it, but for the library, the tools and the program: their
# objects are the main build's (the same sources and flags, checked by python/CMakeLists.txt),
# not compiled a second time.
step "the wheel (scikit-build-core, no build isolation; the main build's objects)"
rm -rf "$work/dist"
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "${lock[@]}" "$python" -m pip wheel -q --no-deps \
  --no-build-isolation --wheel-dir "$work/dist" -C build-dir="$work/cmake" \
  -C cmake.define.NEML2_DISPATCH_REUSE_BUILD="$build" "$root/python"
wheel=("$work"/dist/neml2_dispatch-*.whl)
ls -l "${wheel[0]}"

step "a scratch environment with the wheel"
# A fresh environment whose own site-packages holds only the wheel; a .pth entry lets it
# see the project environment's torch, neml2 and pytest behind it.
rm -rf "$work/venv"
"$python" -m venv --without-pip "$work/venv"
scratch="$work/venv/bin/python"
project_site="$("$python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
scratch_site="$("$scratch" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
echo "$project_site" >"$scratch_site/neml2_dispatch_project_env.pth"
"$python" -m pip --python "$scratch" install -q --no-deps --no-index "${wheel[0]}"

step "pytest against the installed module"
# From the scratch folder, so that python/ in the checkout cannot shadow the installed module.
# Any failure, and pytest's status 5 (no tests collected), fails the script.
(cd "$work" && NEML2_DISPATCH_ARTIFACTS="$build/artifacts" \
  NEML2_DISPATCH_EXPECT_MODULE_UNDER="$work/venv" \
  "$scratch" -m pytest -p no:cacheprovider -q "$root/python/tests" "$@")

step "the example: load, dispatch, tune, plot"
"$scratch" "$root/python/examples/dispatch_and_tune.py" \
  "$build/artifacts/elasticity/elasticity_aoti.i" --batch 65536 --out "$work/dispatch_and_tune.png"
test -s "$work/dispatch_and_tune.png"

step "the example: a NEML2 input file's driver on NEML2's AOTIModel, then on the dispatcher"
"$scratch" "$root/python/examples/run_neml2_driver.py" "$build/artifacts/j2_radial_return/model" \
  --steps 20 --batch 2000

step "the C++ consumer (tests/consumer) against the wheel's package"
prefix="$("$scratch" -m neml2_dispatch --cmake-prefix)"
rm -rf "$work/consumer"
cmake -S "$root/tests/consumer" -B "$work/consumer" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" -DNEML2_DISPATCH_PYTHON="$scratch" >/dev/null
"${lock[@]}" cmake --build "$work/consumer" -j "$(nproc)" >/dev/null
"$work/consumer/consumer" "$build/artifacts/elasticity/elasticity_aoti.i"

step "passed"
