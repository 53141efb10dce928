"""The heap alive after start-up is frozen (chunklocal/_gc.py), so a full collection while
serving walks only what serving made: by the engine when it is built, by the server before
its port opens; what was frozen and died since is freed at the next freeze."""

from __future__ import annotations

import gc
import weakref

import pytest

from chunklocal import _gc


class Node:  # weakref-able, and made cyclic below: only the collector frees it
    pass


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # leave the test process as it found it


def test_freeze_moves_live_objects_out_of_collections(unfrozen, monkeypatch):
    monkeypatch.delenv("CHUNKLOCAL_GC_FREEZE", raising=False)
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    assert _gc.freeze_startup_heap() is True
    assert gc.get_freeze_count() > 1000  # the interpreter's, pytest's, torch's objects
    monkeypatch.setenv("CHUNKLOCAL_GC_FREEZE", "0")
    gc.unfreeze()
    assert _gc.freeze_startup_heap() is False and gc.get_freeze_count() == 0


def test_what_was_frozen_and_died_is_freed_at_the_next_freeze(unfrozen, monkeypatch):
    """An engine built, frozen and dropped (a test's, or one replaced in a process) must
    not live for ever: each freeze unfreezes and collects first."""
    monkeypatch.delenv("CHUNKLOCAL_GC_FREEZE", raising=False)
    node = Node()
    node.self = node  # a cycle: reference counting alone never frees it
    alive = weakref.ref(node)
    _gc.freeze_startup_heap()
    del node
    gc.collect()
    assert alive() is not None  # frozen: collections skip it
    _gc.freeze_startup_heap()
    assert alive() is None


def test_the_engine_freezes_once_built(ckpt, unfrozen, monkeypatch):
    import chunklocal

    monkeypatch.delenv("CHUNKLOCAL_GC_FREEZE", raising=False)
    gc.unfreeze()
    llm = chunklocal.LLM(ckpt[0], max_model_len=128, max_num_seqs=2)
    assert gc.get_freeze_count() > 0
    # the engine is in the permanent generation, which gc.get_objects() (generations 0-2,
    # what collections walk) leaves out
    assert gc.is_tracked(llm) and not any(obj is llm for obj in gc.get_objects())


def test_the_server_freezes_before_its_port_opens(tmp_path, monkeypatch):
    """``chunklocal serve``: after the engine is built, before uvicorn starts."""
    import argparse
    import signal

    import uvicorn
    from fake_core import FakeCore

    from chunklocal.server import cli as serve_cli

    order = []

    class Server:  # uvicorn.Server that cannot bind its port: main returns status 1
        def __init__(self, config):
            self.started = self.should_exit = self.force_exit = False

        def run(self):
            order.append("uvicorn")

    core = FakeCore()
    core.shutdown = lambda: order.append("shutdown")
    monkeypatch.setattr(serve_cli, "make_core", lambda args: order.append("core") or core)
    monkeypatch.setattr(_gc, "freeze_startup_heap", lambda: order.append("freeze"))
    monkeypatch.setattr(uvicorn, "Server", Server)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # pytest keeps its handlers
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    assert serve_cli.main(p.parse_args([str(tmp_path)])) == 1
    assert order == ["core", "freeze", "uvicorn", "shutdown"]
