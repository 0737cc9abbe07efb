#!/usr/bin/env bash
# The README's first command: install, build only what the demo needs (the library, the
# demo and its one model), and run it: a million material points through
# DispatchedModel<SyncChunking>, checked against eager NEML2. scripts/test.sh builds the rest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NEML2_DISPATCH_TARGETS=demo "$root/scripts/build.sh"
build="${NEML2_DISPATCH_BUILD:-$root/build}"
"$build/examples/demo" "$build/artifacts"
