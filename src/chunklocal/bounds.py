"""Upper bounds that size the per-step metadata buffers (placeholder: safe bounds).

Replaced by the exact bounds of issue "Exact bounds".
"""

from __future__ import annotations

from chunklocal._validate import cdiv


def published_virtual_batches_bound(max_num_seqs: int, max_num_batched_tokens: int,
                                    chunk_size: int) -> int:
    """vLLM PR 50022's bound: min(2N + cdiv(T, c), T)."""
    return min(2 * max_num_seqs + cdiv(max_num_batched_tokens, chunk_size), max_num_batched_tokens)


def max_virtual_batches(max_num_seqs: int, max_num_batched_tokens: int, chunk_size: int,
                        max_model_len: int | None = None) -> int:
    bound = published_virtual_batches_bound(max_num_seqs, max_num_batched_tokens, chunk_size)
    if max_model_len is not None:
        bound = min(bound, max_num_seqs * cdiv(max_model_len, chunk_size))
    return bound


def max_local_pages(max_num_seqs: int, max_num_batched_tokens: int, chunk_size: int,
                    max_model_len: int | None, block_size: int) -> int:
    bound = max_virtual_batches(max_num_seqs, max_num_batched_tokens, chunk_size,
                                max_model_len) * cdiv(chunk_size, block_size)
    if max_model_len is not None:
        bound = min(bound, max_num_seqs * cdiv(max_model_len, block_size))
    return bound
