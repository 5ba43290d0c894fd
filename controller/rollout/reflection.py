"""gRPC server reflection on both service names clients use: ``grpc.reflection.v1`` (grpcurl
1.9+, Postman, current grpc-go and grpc-java clients try it first) and
``grpc.reflection.v1alpha`` (older clients).

``grpcio-reflection`` (1.85) ships only the v1alpha service. The v1 protocol
(``grpc/reflection/v1/reflection.proto``) is v1alpha under another package name: the same
messages with the same field numbers, so the same bytes on the wire (grpc-go serves both from
one implementation). So the v1 service is v1alpha's servicer under the v1 method path, and
v1's descriptors (v1alpha's renamed) are added to the descriptor pool, so a client can reflect
on the v1 service itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message_factory import GetMessageClass
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA_SERVICE = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
V1_METHOD = f"/{V1_SERVICE}/ServerReflectionInfo"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def v1_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's reflection.proto as v1: package and type references renamed, options
    (v1alpha's ``deprecated`` and language packages) dropped."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old = "." + proto.package + "."
    proto.name = _V1_FILE
    proto.package = V1_PACKAGE
    proto.ClearField("options")
    for message in proto.message_type:
        for f in message.field:
            if f.type_name.startswith(old):
                f.type_name = f".{V1_PACKAGE}." + f.type_name[len(old):]
    for service in proto.service:
        for method in service.method:
            method.input_type = f".{V1_PACKAGE}." + method.input_type[len(old):]
            method.output_type = f".{V1_PACKAGE}." + method.output_type[len(old):]
    return proto


def v1_messages(pool: Any = None) -> tuple[Any, Any]:
    """The v1 ``ServerReflectionRequest`` and ``ServerReflectionResponse`` classes, from
    ``pool`` (the default pool: where the server's reflection looks symbols up)."""
    pool = pool or descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
    except KeyError:
        pool.AddSerializedFile(v1_file_descriptor().SerializeToString())
    return (GetMessageClass(pool.FindMessageTypeByName(f"{V1_PACKAGE}.ServerReflectionRequest")),
            GetMessageClass(pool.FindMessageTypeByName(f"{V1_PACKAGE}.ServerReflectionResponse")))


def enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Reflection on ``server`` under v1alpha and v1, each listing ``service_names`` and both
    reflection services."""
    v1_messages()  # v1's descriptors in the default pool: reflecting on v1 itself works
    names = (*service_names, V1_SERVICE, V1ALPHA_SERVICE)
    reflection.enable_server_reflection(names, server)
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        # v1 and v1alpha messages are the same bytes: v1alpha's classes read and write v1.
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": handler}),
    ))
