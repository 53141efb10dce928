"""A server of build_app on a uvicorn thread (port 0), for the HTTP tests on a fake core
(the ``tokenizer`` and ``serve`` fixtures of tests/conftest.py start one)."""

from __future__ import annotations

import argparse
import threading
import time

import httpx
import uvicorn

from chunklocal.server.app import build_app


class Served:
    """A running server: ``state``, ``url`` and an httpx ``client`` for it."""

    def __init__(self, state, server, thread):
        self.state, self.server, self.thread = state, server, thread
        port = server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = httpx.Client(base_url=self.url, timeout=10)

    def post(self, path, body, **kw):
        return self.client.post(path, json=body, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve_state(state, timeout: float = 10.0) -> Served:
    """Start ``build_app(state)`` on a free port in a daemon thread; wait until it listens."""
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + timeout
    while not server.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.01)
    return Served(state, server, thread)


def serve_args(*argv) -> argparse.Namespace:
    """``chunklocal serve``'s arguments parsed and checked as the command does."""
    from chunklocal.server import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(list(argv))
    serve_cli.check_arguments(parser, args)
    return args
