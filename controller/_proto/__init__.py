"""Generated protobuf/gRPC code for ``proto/pdcontrol/v1`` (do not edit; see scripts/gen_proto.sh).

Only ``controller.rollout`` imports this package: everything else speaks ``controller.policy``.
"""
