#!/usr/bin/env bash
# The README's first command: install, build, and run the demo (a million material
# points through DispatchedModel<SyncChunking>, checked against eager NEML2).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/build.sh"
build="${NEML2_DISPATCH_BUILD:-$root/build}"
"$build/examples/demo" "$build/artifacts"
