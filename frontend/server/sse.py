"""Server-sent events in OpenAI's streaming format: ``data: {json}\\n\\n`` per chunk, then
``data: [DONE]\\n\\n``. An error after the stream began is sent as one chunk holding the error
envelope, followed by ``[DONE]``, since the status line has already gone out."""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web

from tidal.frontend.server.errors import APIError

_DONE = b"data: [DONE]\n\n"
# What writing to a client that went away raises.
DISCONNECTS = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


class SSEWriter:
    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                # Proxies (nginx) would otherwise buffer the stream and break token timing.
                "X-Accel-Buffering": "no",
            },
        )
        self.started = False
        self.finished = False

    async def start(self) -> None:
        if not self.started:
            await self.response.prepare(self.request)
            self.started = True

    async def send(self, payload: bytes) -> None:
        await self.send_many([payload])

    async def send_many(self, payloads: Sequence[bytes]) -> None:
        """Several events in one write (one system call for what one read of the engine's
        outputs produced)."""
        await self.start()
        await self.response.write(_events(payloads))

    async def fail(self, err: APIError) -> web.StreamResponse:
        """End the stream with ``err`` as its last chunk (unless the client is already gone)."""
        try:
            return await self.finish([err.body()])
        except DISCONNECTS:
            return self.response

    async def finish(self, payloads: Sequence[bytes] = ()) -> web.StreamResponse:
        """End the stream: the last events, ``[DONE]`` and the end of the body in one write."""
        await self.start()
        if not self.finished:
            self.finished = True
            await self.response.write_eof(_events(payloads) + _DONE if payloads else _DONE)
        return self.response


def _events(payloads: Sequence[bytes]) -> bytes:
    if len(payloads) == 1:
        return b"data: " + payloads[0] + b"\n\n"
    return b"".join(b"data: " + p + b"\n\n" for p in payloads)
