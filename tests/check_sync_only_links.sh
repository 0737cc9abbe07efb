#!/usr/bin/env bash
# A program that uses synchronous policies only links none of the hybrid machinery: none of
# its symbols is the worker pool's, the asynchronous schedule's or engine's, or a stream
# helper's. The same search over a program that uses an asynchronous policy must find them
# (else the patterns are stale and the check proves nothing).
#   check_sync_only_links.sh SYNC_ONLY_PROGRAM ASYNC_PROGRAM
set -euo pipefail
patterns='neml2::detail::(WorkerPool|AsyncEngine|AsyncSchedule|CallerStreams|take_rows_staged|own_on_this_stream)'
found_in() { nm -C "$1" | { grep -E "$patterns" || true; } | sed 's/^[0-9a-f ]*[A-Za-z] //' | sort -u; }
sync_found="$(found_in "$1")"
async_found="$(found_in "$2")"
if [ -z "$async_found" ]; then
  echo "FAIL: $2 (an asynchronous policy's program) has no symbol matching $patterns: update the patterns"
  exit 1
fi
if [ -n "$sync_found" ]; then
  echo "FAIL: $1 links the hybrid machinery:"
  echo "$sync_found"
  exit 1
fi
echo "$(basename "$1"): none of the $(echo "$async_found" | wc -l) hybrid symbols $(basename "$2") links"
