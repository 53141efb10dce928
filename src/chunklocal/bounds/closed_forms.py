"""Exact maxima for the per-step metadata buffers (proof: docs/bounds.md).

Buffers are allocated once, before any batch is seen, and CUDA graphs pin their
addresses, so these maxima are the whole safety argument.  Each closed form
equals the true maximum over every batch the engine limits allow (checked by
``chunklocal verify-bounds`` and tests/test_bounds.py), and each has a
``witness_*`` batch that attains it.

Notation: N = max_num_seqs, T = max_num_batched_tokens, c = chunk size,
L = max_model_len, bs = block size, P = c / bs (pages per chunk),
Lp = cdiv(L, bs), K = floor((L - 1) / c) (chunk boundaries below L).  A batch
has n <= N requests with q_i >= 1 query tokens, sum q_i <= T, q_i <= s_i <= L.

Per request (offset o = (s - q) mod c), with the best placement
``s = min(c - 1 + q, L)`` (:func:`best_seq_len`):

* virtual batches ``1 + floor((o + q - 1) / c) <= 1 + min(cdiv(q - 1, c), K)``;
* local pages ``cdiv(o + q, bs) <= min(P + cdiv(q - 1, bs), Lp)``;
* global pages ``cdiv(s, bs) <= Lp``.

Both local maxima are "a base per request, then a first extra unit for one more
token, then each further unit for ``step`` more tokens, up to ``cap`` units".
With n = min(N, T) requests, the optimum buys the first units before any
further unit (:func:`_stepped`); adding a request never lowers the total.

``chunk_size=None`` everywhere means no chunking.  The sizes a backend allocates
are built from these maxima in :mod:`chunklocal.bounds.sizing`.
"""

from __future__ import annotations

from numbers import Integral

import numpy as np

from chunklocal._validate import as_bool, cdiv, check_chunk_geometry


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _limits(max_num_seqs, max_num_batched_tokens, chunk_size, max_model_len, block_size=None):
    """Validated ints; an absent L becomes one large enough never to bind."""
    n_max = _positive("max_num_seqs", max_num_seqs)
    tokens = _positive("max_num_batched_tokens", max_num_batched_tokens)
    chunk = None if chunk_size is None else _positive("chunk_size", chunk_size)
    if block_size is not None:
        block_size = _positive("block_size", block_size)
        if chunk is not None:
            check_chunk_geometry(chunk, block_size)
    if max_model_len is None:
        # q <= T, so any L >= T + c leaves every per-request cap slack.
        model_len = tokens + (chunk or 0) + (block_size or 1)
    else:
        model_len = _positive("max_model_len", max_model_len)
    return n_max, tokens, chunk, model_len, block_size


def _ints(*values) -> bool:
    """Whether every value is a Python int (the scalar path: exact, never wraps)."""
    return all(type(v) is int for v in values)


def _minimum(a, b):
    return min(a, b) if _ints(a, b) else np.minimum(a, b)


def _stepped(n, budget, step, cap):
    """max sum_i min(cdiv(a_i, step), cap) over n requests with sum_i a_i <= budget.

    A first unit costs one token, each further unit ``step``; first units are
    the cheapest, so all min(n, budget) of them are bought first.  Python ints
    (the public bounds, exact at any size) or numpy arrays (the verifier
    evaluates it on whole grids, in int64).
    """
    if _ints(n, budget, step, cap):
        first = min(n, budget) if cap >= 1 else 0
        return first + min((budget - first) // step, first * max(cap - 1, 0))
    first = np.where(cap >= 1, np.minimum(n, budget), 0)
    further = np.minimum((budget - first) // step, first * np.maximum(cap - 1, 0))
    return first + further


# The formulas below take Python ints (exact) or numpy grids (the verifier).
def _virtual_batches_formula(n_max, tokens, chunk, model_len):
    n = _minimum(n_max, tokens)
    return n + _stepped(n, tokens - n, chunk, (model_len - 1) // chunk)


def _local_pages_formula(n_max, tokens, chunk, model_len, block_size):
    n = _minimum(n_max, tokens)
    seq_pages = cdiv(model_len, block_size)
    base = _minimum(chunk // block_size, seq_pages)
    return n * base + _stepped(n, tokens - n, block_size, seq_pages - base)


def _global_pages_formula(n_max, tokens, model_len, block_size):
    return _minimum(n_max, tokens) * cdiv(model_len, block_size)


def published_virtual_batches_bound(max_num_seqs: int, max_num_batched_tokens: int,
                                    chunk_size: int) -> int:
    """vLLM PR 50022's bound min(2N + cdiv(T, c), T): safe, not tight."""
    n_max, tokens, chunk, _, _ = _limits(max_num_seqs, max_num_batched_tokens, chunk_size, None)
    if chunk is None:
        return n_max
    return min(2 * n_max + cdiv(tokens, chunk), tokens)


def max_virtual_batches(max_num_seqs: int, max_num_batched_tokens: int, chunk_size: int | None,
                        max_model_len: int | None = None) -> int:
    """Exact max of virtual batches in one step (any mix of prefill and decode).

    n + f + min(floor((T - n - f) / c), f (K - 1)) with n = min(N, T) and
    f = min(n, T - n) if K >= 1 else 0; for L > c and 2N < T that is
    2N + min(floor((T - 2N) / c), N (K - 1)).  Without chunking: min(N, T).
    Proof: a request is 1 + x virtual batches, x <= min(cdiv(q - 1, c), K)
    crossed boundaries, so its first crossing costs 1 token and each later one
    c; buy the cheap ones first (:func:`_stepped`); one more request never
    lowers the total.  Attained by :func:`witness_virtual_batches`.
    """
    n_max, tokens, chunk, model_len, _ = _limits(max_num_seqs, max_num_batched_tokens,
                                                 chunk_size, max_model_len)
    if chunk is None:
        return min(n_max, tokens)
    return int(_virtual_batches_formula(n_max, tokens, chunk, model_len))


def max_local_pages(max_num_seqs: int, max_num_batched_tokens: int, chunk_size: int | None,
                    max_model_len: int | None, block_size: int) -> int:
    """Exact max of sum over virtual batches of cdiv(keys, bs) (paged_kv_indices length).

    A request reads cdiv(o + q, bs) <= min(P + cdiv(q - 1, bs), Lp) pages
    (o <= c - 1 and o + q <= s <= L), so n = min(N, T) requests give n base +
    _stepped(n, T - n, bs, Lp - base) with base = min(P, Lp): past the first
    query token each bs tokens add one page, up to Lp.  Without chunking every
    request reads cdiv(s, bs) pages: min(N, T) Lp.  Attained by
    :func:`witness_local_pages`.
    """
    n_max, tokens, chunk, model_len, block_size = _limits(
        max_num_seqs, max_num_batched_tokens, chunk_size, max_model_len, block_size)
    if chunk is None:
        if max_model_len is None:
            raise ValueError("max_model_len is required to bound pages without chunking")
        return int(_global_pages_formula(n_max, tokens, model_len, block_size))
    return int(_local_pages_formula(n_max, tokens, chunk, model_len, block_size))


def max_global_pages(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                     block_size: int) -> int:
    """Exact max pages for layers attending the whole sequence: min(N, T) cdiv(L, bs)."""
    if max_model_len is None:
        raise ValueError("max_model_len is required to bound global-layer pages")
    n_max, tokens, _, model_len, block_size = _limits(
        max_num_seqs, max_num_batched_tokens, None, max_model_len, block_size)
    return int(_global_pages_formula(n_max, tokens, model_len, block_size))


def max_group_pages(max_num_seqs: int, max_num_batched_tokens: int, chunk_size: int | None,
                    max_model_len: int, block_size: int, has_global_layers: bool = True) -> int:
    """Pages a KV group's indices buffer needs: local, or max(local, global) if merged.

    Each request's local pages are cdiv(o + q, bs) <= cdiv(s, bs), so with
    global layers present the global need is the maximum.
    """
    has_global_layers = as_bool(has_global_layers, "has_global_layers")
    local = max_local_pages(max_num_seqs, max_num_batched_tokens, chunk_size, max_model_len,
                            block_size)
    if chunk_size is None or not has_global_layers:
        return local
    return max(local, max_global_pages(max_num_seqs, max_num_batched_tokens, max_model_len,
                                       block_size))


def _check_window_fits(q: int, name: str, limit: int) -> None:
    if q > limit:
        raise ValueError(f"a verify step of {q} tokens per request exceeds {name} {limit}")


def _verify_limits(max_num_seqs, num_draft_tokens, chunk_size, max_model_len,
                   max_num_batched_tokens):
    """(n, q, c, L): a verify step has n = min(N, floor(T / q)) requests of q = k + 1."""
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, Integral) \
            or num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be an integer >= 0, got {num_draft_tokens!r}")
    q = int(num_draft_tokens) + 1
    n_max = _positive("max_num_seqs", max_num_seqs)
    chunk = None if chunk_size is None else _positive("chunk_size", chunk_size)
    n = n_max
    if max_num_batched_tokens is not None:
        tokens = _positive("max_num_batched_tokens", max_num_batched_tokens)
        _check_window_fits(q, "max_num_batched_tokens", tokens)
        n = min(n_max, tokens // q)
    # Without L, L = q + 2c never binds: every placement used below ends by q + c.
    model_len = q + 2 * (chunk or 1) if max_model_len is None else \
        _positive("max_model_len", max_model_len)
    _check_window_fits(q, "max_model_len", model_len)
    return n, q, chunk, model_len


def max_verify_batches(max_num_seqs: int, num_draft_tokens: int, chunk_size: int | None,
                       max_model_len: int | None = None,
                       max_num_batched_tokens: int | None = None) -> int:
    """Exact max virtual batches of a verify step (every request has q = k + 1).

    n (1 + min(cdiv(k, c), K)): each request crosses its own boundaries.  2N for
    1 <= k < c and L > c (a window across a boundary), N for k = 0 or L <= c.
    """
    n, q, chunk, model_len = _verify_limits(max_num_seqs, num_draft_tokens, chunk_size,
                                            max_model_len, max_num_batched_tokens)
    if chunk is None:
        return n
    return n * (1 + min(cdiv(q - 1, chunk), (model_len - 1) // chunk))


def _pieces_of_length(q: int, chunk: int | None, model_len: int, length: int):
    """(count, s): the most pieces of one request of q tokens that have q_local = length.

    Pieces are f = min(c - o, q), then whole chunks c, then the rest, so only the
    first and last piece can be shorter than c.  First = length needs s = jc -
    length + q, last = length needs s = jc + length (j >= 1; smallest j is best
    against L); both at once need q = 2 length (mod c).
    """
    if length < 1 or length > q or (chunk is not None and length > chunk):
        return 0, q
    if chunk is None:
        return int(length == q), q
    if length == q:
        return 1, q  # one piece: s = q puts all q tokens in chunk 0 (q <= c here)
    if length == chunk:
        return q // chunk, q  # chunk-aligned; count * length <= q bounds any placement
    first_seq = chunk - length + q
    last_seq = max(1, cdiv(q - length, chunk)) * chunk + length
    if first_seq <= model_len:
        return (2 if (q - 2 * length) % chunk == 0 else 1), first_seq
    if last_seq <= model_len:
        return 1, last_seq
    return 0, q


def _best_length(q: int, chunk: int | None, model_len: int) -> int:
    """The q_local with the most pieces: q, c, or the largest l with 2l = q (mod c)."""
    if chunk is None:
        return q
    rest = q % chunk
    candidates = [q, chunk, (rest + chunk) // 2, rest // 2]
    return max(candidates, key=lambda ell: (_pieces_of_length(q, chunk, model_len, ell)[0],
                                            ell == q))


def max_verify_batches_of_length(max_num_seqs: int, num_draft_tokens: int,
                                 chunk_size: int | None, query_len: int,
                                 max_model_len: int | None = None,
                                 max_num_batched_tokens: int | None = None) -> int:
    """Exact max number of a verify step's virtual batches with q_local == query_len."""
    n, q, chunk, model_len = _verify_limits(max_num_seqs, num_draft_tokens, chunk_size,
                                            max_model_len, max_num_batched_tokens)
    return n * _pieces_of_length(q, chunk, model_len, _positive("query_len", query_len))[0]


def max_uniform_verify_batches(max_num_seqs: int, num_draft_tokens: int,
                               chunk_size: int | None, max_model_len: int | None = None,
                               max_num_batched_tokens: int | None = None) -> int:
    """The uniform-decode count: most virtual batches sharing one q_local in a verify step.

    A per-virtual-batch decode mask cache needs this many entries.  It is 2N
    for even q = k + 1 <= c (odd k; split in halves at a boundary), not N.
    """
    n, q, chunk, model_len = _verify_limits(max_num_seqs, num_draft_tokens, chunk_size,
                                            max_model_len, max_num_batched_tokens)
    ell = _best_length(q, chunk, model_len)
    return n * _pieces_of_length(q, chunk, model_len, ell)[0]
