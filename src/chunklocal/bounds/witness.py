"""Batches that attain each bound of :mod:`chunklocal.bounds.closed_forms` (``witness_*``).

Each ``witness_*`` returns ``(q list, s list)``: a batch within the engine
limits whose virtual batches (or pages) equal the closed form, which shows the
bound is tight (tests/test_bounds.py measures each with make_virtual_batches).
Requests are placed by :func:`best_seq_len`.
"""

from __future__ import annotations

import numpy as np

from chunklocal._validate import cdiv
from chunklocal.bounds.closed_forms import (
    _best_length,
    _limits,
    _pieces_of_length,
    _positive,
    _stepped,
    _verify_limits,
)


def best_seq_len(query_len: int, chunk_size: int | None, max_model_len: int) -> int:
    """The s that maximises both virtual batches and pages for one request of q tokens.

    Start at offset min(c - 1, L - q) in the first chunk: as far right as L allows.
    """
    if chunk_size is None:
        return int(max_model_len)
    return int(min(chunk_size - 1 + query_len, max_model_len))


def _stepped_units(n: int, budget: int, step: int, cap: int) -> np.ndarray:
    """Units per request of the allocation that attains :func:`_stepped`."""
    units = np.zeros(n, dtype=np.int64)
    first = int(min(n, budget)) if cap >= 1 else 0
    further = int(_stepped(n, budget, step, cap)) - first
    units[:first] = 1
    if further:
        full, rest = divmod(further, cap - 1)
        units[:full] += cap - 1
        if rest:  # then full < first: further < first * (cap - 1)
            units[full] += rest
    return units


def _units_to_queries(units: np.ndarray, step: int) -> np.ndarray:
    return 1 + np.where(units > 0, (units - 1) * step + 1, 0)


def _placed(queries, chunk, model_len):
    seqs = [best_seq_len(int(q), chunk, model_len) for q in queries]
    return [int(q) for q in queries], seqs


def witness_virtual_batches(max_num_seqs, max_num_batched_tokens, chunk_size,
                            max_model_len=None):
    """(q list, s list): a batch within the limits with max_virtual_batches of them."""
    n_max, tokens, chunk, model_len, _ = _limits(max_num_seqs, max_num_batched_tokens,
                                                 chunk_size, max_model_len)
    n = min(n_max, tokens)
    if chunk is None:
        return [1] * n, [1] * n
    units = _stepped_units(n, tokens - n, chunk, (model_len - 1) // chunk)
    return _placed(_units_to_queries(units, chunk), chunk, model_len)


def witness_local_pages(max_num_seqs, max_num_batched_tokens, chunk_size, max_model_len,
                        block_size):
    """(q list, s list) attaining max_local_pages."""
    n_max, tokens, chunk, model_len, block_size = _limits(
        max_num_seqs, max_num_batched_tokens, chunk_size, max_model_len, block_size)
    n = min(n_max, tokens)
    if chunk is None:
        return [1] * n, [model_len] * n
    seq_pages = cdiv(model_len, block_size)
    cap = seq_pages - min(chunk // block_size, seq_pages)
    units = _stepped_units(n, tokens - n, block_size, cap)
    return _placed(_units_to_queries(units, block_size), chunk, model_len)


def witness_global_pages(max_num_seqs, max_num_batched_tokens, max_model_len, block_size):
    """(q list, s list) attaining max_global_pages: decodes at full length."""
    n = min(_positive("max_num_seqs", max_num_seqs),
            _positive("max_num_batched_tokens", max_num_batched_tokens))
    _positive("block_size", block_size)
    return [1] * n, [_positive("max_model_len", max_model_len)] * n


def witness_verify_batches(max_num_seqs, num_draft_tokens, chunk_size, max_model_len=None,
                           max_num_batched_tokens=None):
    """(q list, s list) attaining max_verify_batches."""
    n, q, chunk, model_len = _verify_limits(max_num_seqs, num_draft_tokens, chunk_size,
                                            max_model_len, max_num_batched_tokens)
    return [q] * n, [best_seq_len(q, chunk, model_len) if chunk else q] * n


def witness_verify_batches_of_length(max_num_seqs, num_draft_tokens, chunk_size, query_len,
                                     max_model_len=None, max_num_batched_tokens=None):
    """(q list, s list) attaining max_verify_batches_of_length."""
    n, q, chunk, model_len = _verify_limits(max_num_seqs, num_draft_tokens, chunk_size,
                                            max_model_len, max_num_batched_tokens)
    seq = _pieces_of_length(q, chunk, model_len, _positive("query_len", query_len))[1]
    return [q] * n, [seq] * n


def witness_uniform_verify_batches(max_num_seqs, num_draft_tokens, chunk_size,
                                   max_model_len=None, max_num_batched_tokens=None):
    """(q list, s list) attaining max_uniform_verify_batches."""
    n, q, chunk, model_len = _verify_limits(max_num_seqs, num_draft_tokens, chunk_size,
                                            max_model_len, max_num_batched_tokens)
    seq = _pieces_of_length(q, chunk, model_len, _best_length(q, chunk, model_len))[1]
    return [q] * n, [seq] * n

