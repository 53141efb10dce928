"""Input checks shared by every public entry point (one wording, one place)."""

from __future__ import annotations

import numpy as np


def as_int_array(value, name: str, ndim: int) -> np.ndarray:
    """Return ``value`` (numpy array, CPU torch tensor or sequence) as int64 numpy."""
    if hasattr(value, "device") and getattr(value.device, "type", "cpu") != "cpu":
        raise ValueError(f"{name} must be on the CPU, got a tensor on {value.device}")
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        value = value.numpy()
    arr = np.asarray(value)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def check_chunk_geometry(chunk_size: int, block_size: int) -> None:
    """A chunk must be a positive whole number of pages."""
    if int(block_size) <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if int(chunk_size) <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if int(chunk_size) % int(block_size):
        raise ValueError(
            f"chunk_size {chunk_size} is not a multiple of block_size {block_size}: "
            "a chunk must start on a page boundary"
        )


def cdiv(a, b):
    """Ceiling division for ints or integer numpy arrays."""
    return -(-a // b)
