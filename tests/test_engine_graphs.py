"""CUDA-graph layout choice (engine/cuda_graphs.py), pure host logic.

Capture and replay through the engine run on the CPU in tests/test_engine_flashinfer_cpu.py
(the FlashInfer backend against a strict stand-in, graphs recorded by an injected
recorder); the capture itself runs on the GPU in tests/gpu/test_engine_gpu.py.
"""

from __future__ import annotations

from chunklocal.engine.cuda_graphs import CudaGraphs


def test_layout_choice():
    graphs = CudaGraphs.__new__(CudaGraphs)
    graphs.batch_sizes, graphs.query_lens = (1, 2, 4, 8), (1, 4)
    import numpy as np

    layout = graphs.layout_for
    assert layout(np.array([1, 1, 1]), np.zeros(3, int)) == (4, 1)
    assert layout(np.array([4, 4]), np.full(2, 3)) == (2, 4)
    assert layout(np.array([4, 1]), np.array([3, 0])) is None        # ragged
    assert layout(np.array([3, 3]), np.full(2, 2)) is None           # no (B, 3) graph
    assert layout(np.array([5]), np.zeros(1, int)) is None           # a prefill piece
    assert layout(np.ones(9, int), np.zeros(9, int)) is None         # more than B_max
