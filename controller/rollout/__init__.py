"""Adapters out: the router agent library, the protobuf codec, the gRPC client and reconciler."""
