"""Cut requests at chunk boundaries into independent causal attention problems.

Chunked local attention (Llama-4 "iRoPE") lets the query at absolute position
``p`` see the keys ``k <= p`` with ``k // c == p // c``.  Kernels without a chunk
mask get the same result if each request is cut into one *virtual batch* per
chunk its queries touch: inside one chunk the mask is plain bottom-right aligned
causal attention over the keys ``[chunk_start, min(chunk_end, s))``.

Everything here is vectorised over requests and virtual batches (numpy), so the
cost per step does not grow with a Python loop over the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chunklocal._validate import INT32_MAX, as_int_array, check_chunk_geometry, raise_first


@dataclass(frozen=True)
class VirtualBatches:
    """The virtual batches of one step (all arrays numpy int32 unless said).

    ``query_start_loc`` [M+1], ``seq_lens`` [M] (keys seen by each virtual batch),
    ``block_table`` [M, chunk_size // block_size] (pages from ``kv_start // block_size``
    on), ``kv_start`` [M] (absolute position of each virtual batch's first key),
    ``request`` [M] (index of the original request), ``num_batches`` (M).
    """

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    kv_start: np.ndarray
    request: np.ndarray
    num_batches: int

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)



def validate_batch(query_start_loc, seq_lens, block_table, block_size: int):
    """Check one step's batch description; return it as numpy arrays.

    ``query_start_loc``, ``seq_lens`` and the query lengths come back as int64,
    the block table in its own integer dtype (not copied).

    Raises ValueError naming the offending request and value.  Nothing is
    modified, so a rejected batch leaves every caller's state as it was.
    """
    qsl = as_int_array(query_start_loc, "query_start_loc", ndim=1)
    seq = as_int_array(seq_lens, "seq_lens", ndim=1)
    # The table is only indexed: keep its dtype rather than copy it to int64 every step.
    table = as_int_array(block_table, "block_table", ndim=2, keep_dtype=True)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_reqs = seq.shape[0]
    if qsl.shape[0] != num_reqs + 1:
        raise ValueError(
            f"query_start_loc has {qsl.shape[0]} entries but seq_lens has {num_reqs} "
            f"requests; expected {num_reqs + 1} entries"
        )
    if table.shape[0] != num_reqs:
        raise ValueError(
            f"block_table has {table.shape[0]} rows but seq_lens has {num_reqs} requests"
        )
    if qsl.size and qsl[0] < 0:
        raise ValueError(f"query_start_loc[0] must be >= 0, got {int(qsl[0])}")
    query_lens = np.diff(qsl)
    raise_first(query_lens < 0, lambda i: (
        f"query_start_loc decreases at request {i}: {int(qsl[i])} -> {int(qsl[i + 1])}"))
    raise_first(seq < 0, lambda i: f"request {i}: seq_len {int(seq[i])} is negative")
    raise_first(query_lens > seq, lambda i: (
        f"request {i}: query length {int(query_lens[i])} exceeds seq_len {int(seq[i])}"))
    if table.size and (table.dtype.itemsize > 4 or table.dtype == np.uint32):
        # Page ids reach kernels as int32: one range check, only for wider tables.
        out_of_range = (table > INT32_MAX) | (table < -INT32_MAX - 1)
        if out_of_range.any():
            i, j = (int(x) for x in np.argwhere(out_of_range)[0])
            raise ValueError(f"request {i}: block_table[{i}, {j}] = {int(table[i, j])} "
                             "does not fit an int32 page id")
    pages_needed = -(-seq // block_size)
    raise_first(pages_needed > table.shape[1], lambda i: (
        f"request {i}: seq_len {int(seq[i])} needs {int(pages_needed[i])} pages of "
        f"{block_size} tokens but block_table has only {table.shape[1]} columns"))
    # One min over the table clears the usual table, which has no negative entries.
    if table.size and table.dtype.kind == "i" and table.min() < 0:
        _check_no_negative_pages(table, pages_needed)
    return qsl, seq, table, query_lens


def _check_no_negative_pages(table, pages_needed) -> None:
    """A page a request reads (column < its pages_needed) must not be negative.

    Columns past a request's pages are padding (often -1) and stay allowed.  One
    ``np.minimum.reduceat`` over the flat table, with segments alternating between
    a row's used prefix and its unused tail, gives each row's smallest used page in
    a single pass, with no [N, W] mask (faster than a ``table < 0`` mask plus argmax:
    BENCHMARKS.md, "Numbers behind code comments").
    """
    num_reqs, width = table.shape
    flat = table.reshape(-1)
    bounds = np.empty(2 * num_reqs, dtype=np.intp)
    bounds[0::2] = np.arange(num_reqs) * width
    bounds[1::2] = bounds[0::2] + pages_needed
    # The last row's tail is empty when it uses every column; reduceat needs every
    # bound inside the array, and the last segment then runs to its end anyway.
    used_min = np.minimum.reduceat(flat, bounds[:-1] if bounds[-1] == flat.size else bounds)
    # An empty prefix (seq_len 0) reduces to its first element: not a page it reads.
    bad = (used_min[0::2] < 0) & (pages_needed > 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        j = int(np.flatnonzero(table[i, :pages_needed[i]] < 0)[0])
        raise ValueError(f"request {i}: block_table[{i}, {j}] = {int(table[i, j])} "
                         "is not a page of the cache")


def _check_fits_int32(qsl, seq) -> None:
    """Outputs are int32 (what kernels take): refuse values that would wrap."""
    raise_first(seq > INT32_MAX,
                lambda i: f"request {i}: seq_len {int(seq[i])} does not fit int32")
    raise_first(qsl > INT32_MAX, lambda i: (
        f"request {max(i - 1, 0)}: query_start_loc[{i}] = {int(qsl[i])} does not fit int32"))


def virtual_batches_per_request(query_lens, seq_lens, chunk_size: int) -> np.ndarray:
    """Chunks touched by each request's queries (0 for q = 0), int64; inputs validated."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    touched = (seq_lens - 1) // chunk_size - (seq_lens - query_lens) // chunk_size + 1
    return np.where(query_lens > 0, touched, 0)


def make_virtual_batches(
    query_start_loc, seq_lens, block_table, chunk_size: int, block_size: int
) -> VirtualBatches:
    """Split a batch into chunk-aligned virtual batches.

    Request ``i`` has query length ``q_i = query_start_loc[i+1] - query_start_loc[i]``
    and total length ``s_i = seq_lens[i]``; its queries sit at positions
    ``[s_i - q_i, s_i)``.  It yields one virtual batch per chunk those positions
    touch, in request order then chunk order, so the virtual batches' queries
    are the original query rows in their original order.  Requests with
    ``q_i == 0`` (padding) yield none.

    Equal to vLLM's ``make_local_attention_virtual_batches`` whenever all
    ``q_i >= 1``.
    """
    check_chunk_geometry(chunk_size, block_size)
    qsl, seq_lens, block_table, query_lens = validate_batch(
        query_start_loc, seq_lens, block_table, block_size
    )
    return split_batch(qsl, seq_lens, block_table, query_lens, int(chunk_size), block_size)


def split_batch(query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
                query_lens: np.ndarray, chunk_size: int, block_size: int) -> VirtualBatches:
    """:func:`make_virtual_batches` on a batch :func:`validate_batch` already checked.

    The backends validate once in ``build()`` and call this; only the int32 range
    of the outputs is checked here.
    """
    qsl, seq, table, c = query_start_loc, seq_lens, block_table, chunk_size
    _check_fits_int32(qsl, seq)
    context = seq - query_lens
    first_chunk = context // c
    per_request = virtual_batches_per_request(query_lens, seq, c)

    num_batches = int(per_request.sum())
    request = np.repeat(np.arange(seq.shape[0], dtype=np.int64), per_request)
    # Index of each virtual batch inside its request: position minus the
    # request's first slot.
    first_slot = np.cumsum(per_request) - per_request
    local_index = np.arange(num_batches, dtype=np.int64) - first_slot[request]
    chunk_start = (first_chunk[request] + local_index) * c
    req_context = context[request]
    req_seq = seq[request]
    q_begin = np.maximum(chunk_start, req_context)
    q_end = np.minimum(chunk_start + c, req_seq)

    local_qsl = np.empty(num_batches + 1, dtype=np.int64)
    local_qsl[0] = qsl[0] if qsl.size else 0
    np.cumsum(q_end - q_begin, out=local_qsl[1:])
    local_qsl[1:] += local_qsl[0]

    pages_per_chunk = c // block_size
    width = table.shape[1]
    # One flat gather (np.take) is about twice as fast as 2-D fancy indexing here.
    flat = (chunk_start // block_size)[:, None] + np.arange(pages_per_chunk)
    np.minimum(flat, max(width - 1, 0), out=flat)
    flat += (request * width)[:, None]
    if width == 0:
        local_table = np.zeros((num_batches, pages_per_chunk), dtype=np.int64)
    else:
        local_table = np.take(table.reshape(-1), flat)

    return VirtualBatches(
        query_start_loc=local_qsl.astype(np.int32),
        seq_lens=(q_end - chunk_start).astype(np.int32),
        block_table=local_table.astype(np.int32),
        kv_start=chunk_start.astype(np.int32),
        request=request.astype(np.int32),
        num_batches=num_batches,
    )
