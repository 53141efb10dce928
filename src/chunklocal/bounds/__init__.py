"""How big each metadata buffer must be: closed forms, their witnesses, the sizing built
on them, and the brute-force verifier (``chunklocal verify-bounds``, :mod:`.verify`)."""

from chunklocal.bounds.closed_forms import (
    max_global_pages,
    max_group_pages,
    max_local_pages,
    max_uniform_verify_batches,
    max_verify_batches,
    max_verify_batches_of_length,
    max_virtual_batches,
    published_virtual_batches_bound,
)
from chunklocal.bounds.sizing import BufferSizes, buffer_sizes
from chunklocal.bounds.witness import (
    best_seq_len,
    witness_global_pages,
    witness_local_pages,
    witness_uniform_verify_batches,
    witness_verify_batches,
    witness_verify_batches_of_length,
    witness_virtual_batches,
)

__all__ = [
    "BufferSizes", "best_seq_len", "buffer_sizes", "max_global_pages", "max_group_pages",
    "max_local_pages", "max_uniform_verify_batches", "max_verify_batches",
    "max_verify_batches_of_length", "max_virtual_batches", "published_virtual_batches_bound",
    "witness_global_pages", "witness_local_pages", "witness_uniform_verify_batches",
    "witness_verify_batches", "witness_verify_batches_of_length", "witness_virtual_batches",
]
