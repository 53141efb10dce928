"""Input checks shared by every public entry point (one wording, one place)."""

from __future__ import annotations

import argparse
import operator
import os

import numpy as np

INT32_MAX = np.iinfo(np.int32).max  # page ids and lengths reach kernels as int32


def as_int_array(value, name: str, ndim: int, keep_dtype: bool = False) -> np.ndarray:
    """Return ``value`` (numpy array, CPU torch tensor or sequence) as int64 numpy.

    ``keep_dtype=True`` keeps an integer array's own dtype (no copy), for arrays
    that are only indexed, such as a wide block table.
    """
    if hasattr(value, "device") and getattr(value.device, "type", "cpu") != "cpu":
        raise ValueError(f"{name} must be on the CPU, got a tensor on {value.device}")
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        value = value.numpy()
    try:
        arr = np.asarray(value)
    except ValueError:
        # Ragged nested sequences: numpy's "inhomogeneous shape" names nothing.
        raise ValueError(f"{name} must be a {ndim}-D int array, got a ragged sequence "
                         "(rows of different lengths)") from None
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        # astype(int64) would wrap these to negative numbers.
        index = np.unravel_index(int(np.argmax(arr)), arr.shape)
        where = ", ".join(str(int(i)) for i in index)
        raise ValueError(f"{name}[{where}] = {int(arr[index])} does not fit int64")
    if keep_dtype and arr.size:
        return arr
    return arr.astype(np.int64, copy=False)


def as_int(value, name: str) -> int:
    """An exact integer (numpy ints included); no silent truncation of 4.5 to 4."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def as_bool(value, name: str) -> bool:
    """True or False (numpy's too); anything else, even a truthy 'no' or 1, is a mistake."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r}")


def as_optional_bool(value, name: str, none_means: str) -> bool | None:
    """:func:`as_bool`, or None (which means ``none_means``, said in the refusal)."""
    if value is None:
        return None
    try:
        return as_bool(value, name)
    except ValueError:
        raise ValueError(f"{name} must be True, False or None ({none_means}), "
                         f"got {value!r}") from None


def check_chunk_geometry(chunk_size: int, block_size: int) -> None:
    """A chunk must be a positive whole number of pages."""
    if as_int(block_size, "block_size") <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if as_int(chunk_size, "chunk_size") <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if int(chunk_size) % int(block_size):
        raise ValueError(
            f"chunk_size {chunk_size} is not a multiple of block_size {block_size}: "
            "a chunk must start on a page boundary"
        )


def check_window(query_len: int, chunk_size: int | None) -> None:
    """The two-slot layout holds a window of query_len tokens only if query_len <= chunk."""
    if chunk_size is not None and query_len > chunk_size:
        raise ValueError(f"query_len {query_len} exceeds the chunk size {chunk_size}: a graph "
                         "step's window must fit in one chunk so that it touches at most two "
                         "chunks")


def cdiv(a, b):
    """Ceiling division for ints or integer numpy arrays."""
    return -(-a // b)


def raise_first(bad, message) -> None:
    """Raise ``ValueError(message(i))`` for the first index ``i`` where ``bad`` holds.

    One vectorised check over a whole batch; the error names the first
    offending request, and nothing has been modified when it is raised.
    """
    index = np.flatnonzero(bad)
    if index.size:
        raise ValueError(message(int(index[0])))


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts and sizes: a bad value stops the command before work."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def env_count(name: str, default: str, unit: str) -> int:
    """Environment variable ``name`` (``default`` when unset) as a whole number of
    ``unit``: anything else is a ValueError naming the variable and its value."""
    value = os.environ.get(name, default)
    if not value.isdigit():
        raise ValueError(f"{name}={value!r}: expected a whole number of {unit}")
    return int(value)
