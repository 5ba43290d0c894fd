#!/usr/bin/env bash
# CI gate for the gRPC contract (Makefile target `proto-check`):
#   1. regenerate controller/_proto into a temporary directory and diff it against the
#      committed generated files (a stale or hand-edited file fails);
#   2. `buf lint` (STANDARD rules, buf.yaml) and `buf format` on proto/.
# buf comes from npm (@bufbuild/buf, pinned in package.json); installed with `npm ci` when
# node_modules is missing. Exits non-zero on any diff or lint error.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
committed=controller/_proto/pdcontrol/v1
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

bash scripts/gen_proto.sh "$tmp"
status=0
# Compare generated files only (both directions: new, changed and missing files).
list() { find "$1" -maxdepth 1 -name '*_pb2*' -printf '%f\n' | sort; }
if ! diff -u <(list "$committed") <(list "$tmp/pdcontrol/v1"); then
    echo "generated file set differs from proto/: run scripts/gen_proto.sh and commit" >&2
    status=1
fi
for f in $(list "$tmp/pdcontrol/v1"); do
    if [ -f "$committed/$f" ] && ! diff -u "$committed/$f" "$tmp/pdcontrol/v1/$f"; then
        echo "stale generated file $committed/$f: run scripts/gen_proto.sh and commit" >&2
        status=1
    fi
done

if [ ! -x node_modules/.bin/buf ]; then
    npm ci --no-audit --no-fund >/dev/null
fi
node_modules/.bin/buf lint || { echo "buf lint failed" >&2; status=1; }
node_modules/.bin/buf format -d --exit-code || { echo "buf format: run 'npx buf format -w'" >&2; status=1; }

if [ "$status" -eq 0 ]; then
    echo "proto-check: generated code current, buf lint and format clean"
fi
exit "$status"
