"""Undecodable request bytes get INVALID_ARGUMENT instead of grpc.aio's UNKNOWN (a server interceptor).

grpc.aio turns an exception raised while parsing a request message into UNKNOWN ("Unexpected
DecodeError"). That reads like a server bug, so every SpecPipe server installs MalformedRequestInterceptor:
it parses with the method's own deserializer and, when that fails, hands the handler a `Malformed`
marker instead of raising; the wrapped handler answers INVALID_ARGUMENT (for a streamed request, at the
first bad message, ending that stream only). Well-formed requests reach the handler unchanged.
"""
from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

_MAKE = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
         (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


class Malformed:
    """Stands in for a request message whose bytes did not parse."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return wrap(handler, details.method)


def wrap(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """The same handler, parsing with a deserializer that never raises and refusing Malformed requests."""
    streaming_in, streaming_out = handler.request_streaming, handler.response_streaming
    inner = {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
             (True, False): handler.stream_unary, (True, True): handler.stream_stream}[(streaming_in, streaming_out)]
    parse = _safe(handler.request_deserializer, method)

    async def refuse(context: grpc.aio.ServicerContext, bad: Malformed) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad.error)

    async def checked(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
        async for msg in requests:
            if isinstance(msg, Malformed):
                await refuse(context, msg)
            yield msg

    def arg(request, context):
        return checked(request, context) if streaming_in else request

    if streaming_out and inspect.isasyncgenfunction(inner):
        async def behavior(request, context):
            if isinstance(request, Malformed):
                await refuse(context, request)
            responses = inner(arg(request, context), context)
            try:
                async for out in responses:
                    yield out
            finally:
                await responses.aclose()        # the handler's own clean-up runs now, not at garbage collection
    else:
        async def behavior(request, context):
            if isinstance(request, Malformed):
                await refuse(context, request)
            result = inner(arg(request, context), context)
            return await result if inspect.isawaitable(result) else result

    return _MAKE[(streaming_in, streaming_out)](behavior, request_deserializer=parse,
                                                 response_serializer=handler.response_serializer)


def _safe(deserializer: Callable[[bytes], object], method: str) -> Callable[[bytes], object]:
    def parse(raw: bytes) -> object:
        try:
            return deserializer(raw)
        except Exception as e:      # protobuf's DecodeError, or whatever a custom deserializer raises
            return Malformed(f"{method}: the request is not a valid message ({type(e).__name__}: {e})")
    return parse
