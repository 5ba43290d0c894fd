#!/usr/bin/env bash
# Regenerate the Python code for proto/pdcontrol/v1/*.proto into controller/_proto/.
#
#   scripts/gen_proto.sh [OUT_ROOT]     (default OUT_ROOT: controller/_proto)
#
# Needs grpcio-tools==1.85.1 and mypy-protobuf==5.1.0 (the `dev` extra); protoc-gen-mypy
# must be on PATH, so run it with the virtual environment's bin first on PATH (the Makefile
# does). Commit the result: CI regenerates into a temporary directory and fails on any diff
# (scripts/check_generated.sh).
#
# Layout and the one post-processing step: protoc writes proto/pdcontrol/v1/x.proto to
# OUT_ROOT/pdcontrol/v1/x_pb2.py, and the generated modules import each other with absolute
# imports mirroring the proto path ("from pdcontrol.v1 import policy_pb2"). We keep a single
# top-level Python package (controller), so those imports are rewritten to
# "from controller._proto.pdcontrol.v1 import ...", and the module name handed to the
# protobuf builder is rewritten the same way (so message classes report their real module).
# The serialized descriptors are not touched: the proto file names and the package
# "pdcontrol.v1" on the wire stay exactly as in proto/.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$here/controller/_proto}"
python="${PYTHON:-python}"
cd "$here"

mkdir -p "$out/pdcontrol/v1"
# Remove what an earlier run generated, so a deleted .proto leaves nothing behind.
find "$out/pdcontrol/v1" -maxdepth 1 \( -name '*_pb2.py' -o -name '*_pb2.pyi' \
    -o -name '*_pb2_grpc.py' -o -name '*_pb2_grpc.pyi' \) -delete

protos=(proto/pdcontrol/v1/*.proto)
services=(proto/pdcontrol/v1/*_service.proto)
"$python" -m grpc_tools.protoc -Iproto --python_out="$out" --mypy_out="$out" "${protos[@]}" \
    >/dev/null 2> >(grep -v "^Writing mypy to" >&2)
# gRPC stubs only for files that define services (policy.proto has none).
"$python" -m grpc_tools.protoc -Iproto --grpc_python_out="$out" --mypy_grpc_out="$out" \
    "${services[@]}" >/dev/null 2> >(grep -v "^Writing mypy to" >&2)

for f in "$out"/pdcontrol/v1/*_pb2*.py "$out"/pdcontrol/v1/*_pb2*.pyi; do
    sed -i -E \
        -e 's/^from pdcontrol\.v1 import /from controller._proto.pdcontrol.v1 import /' \
        -e "s/^(_builder\.BuildTopDescriptorsAndMessages\(DESCRIPTOR, ')pdcontrol\.v1\./\1controller._proto.pdcontrol.v1./" \
        "$f"
done

# Package markers (kept when regenerating into a scratch directory for the CI diff).
for pkg in "$out/pdcontrol" "$out/pdcontrol/v1"; do
    [ -f "$pkg/__init__.py" ] || : >"$pkg/__init__.py"
done
