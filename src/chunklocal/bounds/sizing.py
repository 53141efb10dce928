"""The one place that decides how big every metadata buffer is.

A backend allocates, per layer kind of a KV group (:class:`~chunklocal.kv_spec.Kind`),
one buffer set of :class:`Capacity`: the exact step maxima of
:mod:`chunklocal.bounds.closed_forms`, widened to hold the padded slot layouts of
every captured CUDA-graph batch size.  :func:`backend_capacities` is what the
FlashInfer backend allocates from and what ``chunklocal plan`` prints;
:func:`buffer_sizes` summarises the same numbers for one KV group.

Invariant: every batch within the engine limits, eager or padded to a captured
graph shape, fits the capacity of each kind without growing a buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

from chunklocal._validate import cdiv, check_window
from chunklocal.bounds.closed_forms import (
    _positive,
    max_global_pages,
    max_local_pages,
    max_uniform_verify_batches,
    max_verify_batches,
    max_virtual_batches,
)
from chunklocal.kv_spec import Kind, attention_kinds, chunk_size_of


@dataclass(frozen=True)
class Capacity:
    """Slots (attention problems; indptr has ``batches + 1`` entries) and page indices."""

    batches: int
    pages: int

    def union(self, other: Capacity) -> Capacity:
        return Capacity(max(self.batches, other.batches), max(self.pages, other.pages))

    def buffer_lengths(self) -> dict[str, int]:
        """Entries of each int32 metadata buffer (the indices buffer is never empty)."""
        return {"qo_indptr": self.batches + 1, "paged_kv_indptr": self.batches + 1,
                "paged_kv_last_page_len": self.batches,
                "paged_kv_indices": max(self.pages, 1)}


def step_capacity(spec, limits, *, kind: Kind) -> Capacity:
    """Most slots and pages one eager step can need, for one layer kind of ``spec``.

    CHUNKED sizes the virtual batches of the spec's chunk size; GLOBAL sizes whole
    requests (a plain full spec, or the global layers of a merged group).
    """
    n_max, tokens = limits.max_num_seqs, limits.max_num_batched_tokens
    model_len, block_size = limits.max_model_len, spec.block_size
    if kind is Kind.GLOBAL:
        pages = max_global_pages(n_max, tokens, model_len, block_size)  # validates first
        return Capacity(min(n_max, tokens), pages)
    chunk_size = chunk_size_of(spec)
    if chunk_size is None:
        raise ValueError(f"kind CHUNKED needs a spec with a chunk size, got {spec!r}")
    return Capacity(max_virtual_batches(n_max, tokens, chunk_size, model_len),
                    max_local_pages(n_max, tokens, chunk_size, model_len, block_size))


def slot_page_limits(chunk_size: int | None, query_len: int, model_len: int,
                     block_size: int) -> tuple[int, ...]:
    """Most pages each slot of one request's padded graph layout can read.

    Decode (``query_len == 1``) and global layers use one slot per request; a
    chunked verify window uses two (first chunk, last chunk) when a chunk
    boundary can fall inside it.  The first slot reads from the previous chunk's
    start through the window's end: at most ``c + query_len - 1`` keys.
    """
    check_window(query_len, chunk_size)
    seq_pages = cdiv(model_len, block_size)
    if chunk_size is None:
        return (seq_pages,)
    last = min(cdiv(chunk_size, block_size), seq_pages)
    if query_len == 1 or model_len <= chunk_size:
        return (last,)
    return (min(cdiv(chunk_size + query_len - 1, block_size), seq_pages), last)


def graph_capacity(batch_sizes, chunk_size: int | None, query_len: int, model_len: int,
                   block_size: int) -> Capacity:
    """Slots and pages of the padded layouts of every captured batch size."""
    per_slot = slot_page_limits(chunk_size, query_len, model_len, block_size)
    biggest = max(batch_sizes, default=0)
    return Capacity(biggest * len(per_slot), biggest * sum(per_slot))


def group_capacities(spec, limits, graph_batch_sizes=(), query_lens=(1,)) -> dict[Kind, Capacity]:
    """Capacity per layer kind of ``spec``: the step bound, widened for graph layouts."""
    out = {}
    for kind in attention_kinds(spec):
        capacity = step_capacity(spec, limits, kind=kind)
        chunk_size = chunk_size_of(spec) if kind is Kind.CHUNKED else None
        for query_len in query_lens:
            capacity = capacity.union(graph_capacity(graph_batch_sizes, chunk_size, query_len,
                                                     limits.max_model_len, spec.block_size))
        out[kind] = capacity
    return out


def default_graph_batch_sizes(limit: int) -> tuple[int, ...]:
    """Powers of two up to ``limit``, and ``limit`` itself."""
    sizes = {1 << i for i in range(max(limit, 1).bit_length()) if 1 << i <= limit}
    return tuple(sorted(sizes | {limit}))


def piecewise_buckets(max_tokens: int, step: int = 16, per_octave: int = 8) -> tuple[int, ...]:
    """Token counts the piecewise graphs (engine/piecewise_graphs.py) are captured at, up to
    and including ``max_tokens``: multiples of ``step`` up to ``step * per_octave``, then
    ``per_octave`` evenly spaced sizes per power of two.  A step of T tokens runs at the
    smallest bucket >= T, so padding adds less than 1 / per_octave of T from there on
    (bucket b follows b - b / per_octave at most; below, less than ``step`` rows)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    sizes = set(range(step, step * per_octave + 1, step))
    octave = step * per_octave
    while octave < max_tokens:
        sizes.update(range(octave, 2 * octave + 1, octave // per_octave))
        octave *= 2
    return tuple(sorted({b for b in sizes if b < max_tokens} | {max_tokens}))


def graph_shapes(limits, cuda_graphs: bool, verify_len: int | None = None,
                 graph_batch_sizes=None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(captured batch sizes, captured query lengths); both empty-ish without graphs."""
    if not cuda_graphs:
        return (), (1,)
    n_limit = min(limits.max_num_seqs, limits.max_num_batched_tokens)
    sizes = tuple(sorted({int(b) for b in (graph_batch_sizes
                                            or default_graph_batch_sizes(n_limit))}))
    if sizes[0] < 1 or sizes[-1] > n_limit:
        raise ValueError(f"graph batch sizes must lie in [1, {n_limit}], got {sizes}")
    return sizes, (1,) + ((verify_len,) if verify_len else ())


@dataclass(frozen=True)
class BackendSizes:
    """Everything a backend of one KV group allocates for its metadata."""

    graph_batch_sizes: tuple[int, ...]
    graph_query_lens: tuple[int, ...]
    capacities: dict[Kind, Capacity]
    verify_rows: int  # rows of the verify_use_first mask (graph verify windows)


def backend_capacities(spec, limits, cuda_graphs: bool = False, verify_len: int | None = None,
                       graph_batch_sizes=None) -> BackendSizes:
    """What a backend for ``spec`` allocates: per kind, with the CUDA-graph room."""
    sizes, query_lens = graph_shapes(limits, cuda_graphs, verify_len, graph_batch_sizes)
    verify_rows = max(sizes, default=0) * (verify_len or 0) if cuda_graphs else 0
    return BackendSizes(sizes, query_lens, group_capacities(spec, limits, sizes, query_lens),
                        verify_rows)


#: Earlier keys one gathered block holds, per token a step may schedule
#: (:func:`gathered_key_capacity`).
GATHER_KEYS_PER_TOKEN = 4


def gathered_key_capacity(limits) -> int:
    """Keys (rows of ``[num_kv_heads, head_dim]``, K and V each) of the buffer into which
    the ragged path copies a long segment's earlier keys from the pages
    (backends/flashinfer/ragged.py ``split_earlier``): ``GATHER_KEYS_PER_TOKEN *
    max_num_batched_tokens``.  No step outgrows it: a step's gathered keys are cut into
    blocks of at most this many, each copied into the same buffer after the last block's
    kernel read it (one stream), and the backend's block count caps what is gathered
    (``GATHER_MAX_BLOCKS``; the rest stays paged).  Four steps' worth keeps a block's kernel
    large (32k keys for 8k queries) at 2 x 4 x 8192 x 8 x 128 x 2 B = 128 MiB for Scout's
    bf16 K and V."""
    return GATHER_KEYS_PER_TOKEN * _positive("max_num_batched_tokens",
                                             limits.max_num_batched_tokens)


@dataclass(frozen=True)
class BufferSizes:
    """Per-step metadata buffer sizes for one KV group (all exact maxima)."""

    num_batches: int  # attention problems per step: virtual batches, or requests
    indptr_len: int  # qo_indptr and paged_kv_indptr entries
    last_page_len_len: int  # paged_kv_last_page_len entries
    num_pages: int  # paged_kv_indices entries (max over the group's layer kinds)
    local_pages: int  # pages over virtual batches of chunked layers (0 without chunking)
    global_pages: int  # pages of layers attending the whole sequence (0 if none)
    query_tokens: int  # query rows per step (T)
    verify_batches: int | None = None  # virtual batches of a verify step (k draft tokens)
    uniform_verify_batches: int | None = None  # most virtual batches of one q_local


@dataclass(frozen=True)
class SpecShape:
    """What sizing reads from a KV spec, for callers without head geometry (the CLI)."""

    attention_chunk_size: int | None
    block_size: int
    has_global_layers: bool


def buffer_sizes(spec_or_chunk, limits, num_draft_tokens: int | None = None, *,
                 graph_batch_sizes=(), graph_query_lens=(1,)) -> BufferSizes:
    """Size every metadata buffer of a KV group from the engine limits.

    ``spec_or_chunk`` is a KV spec (its chunk size and block size are used; a merged
    group with global layers also gets the global page need) or a chunk size / None
    with ``limits.block_size``.  The numbers are those of :func:`group_capacities`
    (no graph room unless ``graph_batch_sizes`` is given), merged over the kinds.
    """
    if spec_or_chunk is None or isinstance(spec_or_chunk, Integral):
        if spec_or_chunk is not None:  # 0 is not "no chunking"
            _positive("chunk_size", spec_or_chunk)
        if isinstance(spec_or_chunk, bool):
            raise ValueError(f"chunk_size must be a positive integer, got {spec_or_chunk!r}")
        spec = SpecShape(spec_or_chunk, limits.block_size, spec_or_chunk is None)
    elif not hasattr(spec_or_chunk, "block_size"):
        raise ValueError("spec_or_chunk must be a KV spec (with a block_size), an integer "
                         f"chunk size or None, got {spec_or_chunk!r}")
    else:
        spec = spec_or_chunk
    caps = group_capacities(spec, limits, graph_batch_sizes, graph_query_lens)
    batches = max(c.batches for c in caps.values())
    verify = uniform = None
    if num_draft_tokens is not None:
        verify_args = (limits.max_num_seqs, num_draft_tokens, chunk_size_of(spec),
                       limits.max_model_len, limits.max_num_batched_tokens)
        verify = max_verify_batches(*verify_args)
        uniform = max_uniform_verify_batches(*verify_args)
    local = caps[Kind.CHUNKED].pages if Kind.CHUNKED in caps else 0
    glob = caps[Kind.GLOBAL].pages if Kind.GLOBAL in caps else 0
    return BufferSizes(
        num_batches=batches, indptr_len=batches + 1, last_page_len_len=batches,
        num_pages=max(local, glob), local_pages=local, global_pages=glob,
        query_tokens=int(limits.max_num_batched_tokens), verify_batches=verify,
        uniform_verify_batches=uniform,
    )
