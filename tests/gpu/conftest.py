"""GPU suite setup: one trained copy model per run, shared by every module that needs it.

Training the tiny copy-task Llama-4 takes about 50 s on an H200; four modules compare
their engines on the same geometry, so it is trained once per session (``copy_model``)
instead of once per module.  ``CHUNKLOCAL_TEST_LOG=path`` appends each test phase's
outcome and duration to ``path`` as it finishes, so a run cut short by a time limit
still says what ran and how long it took.
"""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def copy_model(tmp_path_factory):
    """Path of the tiny Llama-4 trained (on the GPU) to continue repeated segments."""
    from llama4_tiny import COPY_GEOMETRY, train_copy_llama4_or_fail

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = tmp_path_factory.mktemp("llama4_copy")
    train_copy_llama4_or_fail(path, "cuda", vocab_size=128, **COPY_GEOMETRY)
    torch.cuda.empty_cache()
    return path


def pytest_runtest_logreport(report):
    log = os.environ.get("CHUNKLOCAL_TEST_LOG")
    if log and (report.when == "call" or report.outcome != "passed"):
        with open(log, "a") as f:
            f.write(f"{report.duration:8.1f}s {report.when:8s} {report.outcome:8s} "
                    f"{report.nodeid}\n")
