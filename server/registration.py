"""A service registered as its generated `add_*Servicer_to_server` registers it, but with some methods' request
deserializers replaced: how a server reads a message its own way (weight chunks without copying their bytes,
samples one by one when the whole message does not parse) and keeps every other method as generated."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import grpc

Deserializer = Callable[[bytes], Any]
Registration = Callable[[Any, Any], None]  # (servicer, server), as the generated add_*Servicer_to_server


def with_deserializers(add: Registration, **deserializers: Deserializer) -> Registration:
    """`add` (a generated `add_*Servicer_to_server`) with each named method's request read by its deserializer."""

    def register(servicer: Any, server: Any) -> None:
        proxy = _Registrar(server, deserializers)
        add(servicer, proxy)
        if proxy.generic is not None:  # generated code that registers no method table: keep it as generated
            server.add_generic_rpc_handlers(proxy.generic)

    return register


def _reading_with(h: Any, deserializer: Deserializer) -> grpc.RpcMethodHandler:
    """The same handler (its kind, behaviour and response serializer) with `deserializer` reading its requests."""
    out = h.response_serializer
    if h.request_streaming and h.response_streaming:
        return grpc.stream_stream_rpc_method_handler(h.stream_stream, deserializer, out)
    if h.request_streaming:
        return grpc.stream_unary_rpc_method_handler(h.stream_unary, deserializer, out)
    if h.response_streaming:
        return grpc.unary_stream_rpc_method_handler(h.unary_stream, deserializer, out)
    return grpc.unary_unary_rpc_method_handler(h.unary_unary, deserializer, out)


class _Registrar:
    """Stands in for the server while the generated code registers its service: the methods named get their own
    deserializers, every other method its generated one."""

    def __init__(self, server: Any, deserializers: Mapping[str, Deserializer]) -> None:
        self.server = server
        self.deserializers = deserializers
        self.generic: Any = None

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic = handlers  # replaced by one built from the patched table in add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        missing = self.deserializers.keys() - handlers.keys()
        if missing:
            raise ValueError(f"{service} has no method {', '.join(sorted(missing))} to read with its own deserializer")
        handlers = {name: _reading_with(h, self.deserializers[name]) if name in self.deserializers else h
                    for name, h in handlers.items()}  # fmt: skip
        self.generic = None
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        self.server.add_registered_method_handlers(service, handlers)
