#!/usr/bin/env bash
# A program that uses synchronous policies only links none of the hybrid machinery: none of
# its symbols is the worker pool's, the asynchronous schedule's or engine's, or a stream
# helper's. The same search over a program that uses an asynchronous policy must find them
# (else the patterns are stale and the check proves nothing). Given the library's archive,
# also what makes this so by construction: each object of the asynchronous engine, the worker
# pool and submitted calls defines no global symbol outside namespace neml2
# (cmake/LocalizeSymbols.cmake), so no other library's weak inline copy can pull one in.
#   check_sync_only_links.sh SYNC_ONLY_PROGRAM ASYNC_PROGRAM [LIBRARY_ARCHIVE]
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
# No archive (an empty third argument too: the sanitizer builds, which do not localize).
[ -n "${3:-}" ] || exit 0
members='^(async_schedule|async_engine|streams|worker_pool|submitted)\.cpp\.o$'
checked="$(ar t "$3" | grep -cE "$members" || true)"
if [ "$checked" -ne 5 ]; then
  echo "FAIL: $3 holds $checked of the 5 asynchronous objects (a unity build or a rename?)"
  exit 1
fi
foreign="$(nm -A --defined-only -g "$3" | grep -E ':(async_schedule|async_engine|streams|worker_pool|submitted)\.cpp\.o:' |
  awk '{print $NF}' | grep -v '5neml2' | sort -u || true)"
if [ -n "$foreign" ]; then
  echo "FAIL: the asynchronous objects of $(basename "$3") define global symbols outside neml2 (any could pull them into a synchronous program):"
  echo "$foreign" | head -20
  exit 1
fi
echo "$(basename "$3"): its 5 asynchronous objects define no global symbol outside neml2"
