"""The load generator's HTTP client: one keep-alive HTTP/1.1 connection per simulated
client on plain asyncio streams, reading a streamed response's server-sent events.

On the CPU the load generator shares the server's cores, so what it spends per chunk is
taken from the server: httpx's streaming reader spent about 400 us of CPU per chunk (the
whole server about as much), this about a tenth of that.  It speaks only what
``chunklocal serve`` answers with (uvicorn: a status line, headers, then a chunked or
Content-Length body).
"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit


class HTTPStatusError(Exception):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status, self.body = status, body


class Connection:
    """One keep-alive connection to ``url``; ``stream_events`` posts a JSON body and yields
    the ``data:`` payloads of the answer's events as they arrive."""

    def __init__(self, url: str, headers: dict[str, str] | None = None):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.head = (f"Host: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                     f"Accept: text/event-stream\r\n{extra}")
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None

    async def _send(self, path: str, body: bytes) -> None:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(f"POST {path} HTTP/1.1\r\n{self.head}Content-Length: {len(body)}"
                          "\r\n\r\n".encode() + body)
        await self.writer.drain()

    async def _body_pieces(self, path: str, body: bytes):
        await self._send(path, body)
        reader = self.reader
        assert reader is not None
        status_line = await reader.readline()
        if not status_line:
            await self.close()
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split(b" ", 2)[1])
        chunked, length, close = False, None, False
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "transfer-encoding" and "chunked" in value:
                chunked = True
            elif name == "content-length":
                length = int(value)
            elif name == "connection" and value == "close":
                close = True
        if status != 200:
            data = await reader.readexactly(length) if length is not None else b""
            await self.close()
            raise HTTPStatusError(status, data)
        if chunked:
            while True:
                size = int((await reader.readline()).split(b";", 1)[0], 16)
                if size == 0:
                    await reader.readline()  # the empty trailer
                    break
                piece = await reader.readexactly(size + 2)
                yield piece[:-2]
        elif length is not None:
            yield await reader.readexactly(length)
        if close:
            await self.close()

    async def stream_events(self, path: str, payload: dict):
        """The decoded JSON of each ``data:`` event ([DONE] ends it)."""
        buffer = b""
        try:
            async for piece in self._body_pieces(path, json.dumps(payload).encode()):
                buffer += piece
                while (end := buffer.find(b"\n\n")) >= 0:
                    event, buffer = buffer[:end], buffer[end + 2:]
                    if not event.startswith(b"data: "):
                        continue
                    if event == b"data: [DONE]":
                        continue
                    yield json.loads(event[6:])
        except BaseException:
            await self.close()  # a half-read answer leaves the connection unusable
            raise
