"""Shared pytest setup: puts tests/ (for ``from oracle import ...``, tests/gpu too) and the
repository root (for ``import benchmarks``) on sys.path, whatever directory pytest runs from."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch

_TESTS = Path(__file__).resolve().parent
for _path in (str(_TESTS), str(_TESTS.parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
# Each engine built freezes the heap after a full collection (chunklocal/_gc.py): in a test
# process holding hundreds of engines' worth of objects that doubled the engine files' time.
# Off here unless a run sets it; tests/test_gc_freeze.py turns it on for its own checks.
os.environ.setdefault("CHUNKLOCAL_GC_FREEZE", "0")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models (hidden size 64): one torch thread beats two (no fork/join per matmul).
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The default tiny checkpoint (llama4_tiny.write_tiny_llama4, seed 0), one per module:
    (path, transformers model).  4 layers (3 chunked RoPE + 1 global NoPE), c=32, MoE on
    layers 1 and 3, GQA 4/2.  A module with another checkpoint defines its own ``ckpt``."""
    from llama4_tiny import write_tiny_llama4

    path = tmp_path_factory.mktemp("llama4_tiny")
    return path, write_tiny_llama4(path, seed=0)


@pytest.fixture(scope="session")
def served_ckpt(tmp_path_factory):
    """A tiny Llama-4 (vocabulary 384) with the tiny byte-level tokenizer and its chat
    template: what a server serves.  One per session, read-only (copy it to change it)."""
    from llama4_tiny import write_tiny_llama4
    from tiny_tokenizer import write_tiny_tokenizer

    path = tmp_path_factory.mktemp("served_ckpt")
    write_tiny_llama4(path, vocab_size=384)
    write_tiny_tokenizer(path, vocab_size=384)
    return path


@pytest.fixture
def hold_steps():
    """``gate, entered = hold_steps(llm)``: from then on every engine step (``llm.runner.launch``,
    which the synchronous ``run`` calls too) sets ``entered`` and waits (30 s at most) for
    ``gate`` before it runs.  At teardown the gate opens and the real ``launch`` is back."""
    held = []

    def hold(llm):
        gate, entered = threading.Event(), threading.Event()
        real_launch = llm.runner.launch

        def gated(batch, prev=None):
            entered.set()
            gate.wait(30)
            return real_launch(batch, prev)

        llm.runner.launch = gated
        held.append((llm, real_launch, gate))
        return gate, entered

    yield hold
    for llm, real_launch, gate in reversed(held):
        llm.runner.launch = real_launch
        gate.set()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny tokenizer (tiny_tokenizer.py) the HTTP tests' fake core speaks."""
    from tiny_tokenizer import write_tiny_tokenizer
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture
def serve(monkeypatch):
    """``serve(core, api_key=None, limits=None, **config)``: a running server over ``core``
    (a fake one from fake_core.py, or None: not loaded yet), stopped after the test."""
    from fake_core import FakeParams, QueueFullError
    from server_harness import serve_state

    from chunklocal.server import generate
    from chunklocal.server.app import ServerConfig, ServerState
    from chunklocal.server.params import ServeLimits

    monkeypatch.setattr(generate, "sampling_params_class", lambda: FakeParams)
    monkeypatch.setattr(generate, "_queue_full_class", lambda: QueueFullError)
    started = []

    def start(core, api_key=None, limits=None, **config):
        state = ServerState(ServerConfig(["tiny"], "/models/tiny", api_key,
                                         limits or ServeLimits(), **config))
        if core is not None:
            state.set_core(core)
        served = serve_state(state)
        started.append(served)
        return served

    yield start
    for s in started:
        s.stop()
