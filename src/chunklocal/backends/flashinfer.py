"""FlashInfer backend: chunked-local and global layers over a paged KV cache.

One ``FlashInferBackend`` per KV group.  ``build()`` runs once per step on the host,
``forward()`` once per layer and makes no host decisions.

Eager steps (``build(qsl, seq_lens, block_table)``): chunked layers are cut into
virtual batches; prefill / mixed steps plan ``BatchPrefillWithPagedKVCacheWrapper``
(causal), pure-decode steps a tensor-core ``BatchDecodeWithPagedKVCacheWrapper``,
each once per step from the pinned mirrors of :class:`MetadataBuffers`.  The
prefill kernel defaults to FA2 (``prefill_backend="fa2"``): FlashInfer's FA3 kernel
(``"auto"`` on sm90) is faster and matched the reference in every normal run, but
gave wrong rows under compute-sanitizer memcheck where FA2 stayed exact
(docs/gpu.md), so it is opt-in.

CUDA graphs (``cuda_graphs=True``), the API the engine uses::

    backend.graph_batch_sizes         # captured sizes B (sorted tuple)
    backend.graph_query_lens          # (1,) or (1, verify_len)
    # per step, outside the graph (host metadata, 3 non-blocking copies):
    md = backend.build(qsl, seq_lens, block_table, graph_batch_size=B)
    # or inside the graph (device metadata, no host sync; seq_lens == 0 pads):
    md = backend.build_on_device(seq_lens_gpu, block_table_gpu, graph_batch_size=B,
                                 query_len=1)
    out = backend.forward(md, q, k_cache, v_cache, scale)   # q: [B * query_len, Hq, D]

For each (B, query_len) there is one decode wrapper (tensor cores, ``use_cuda_graph``)
whose indptr / last_page_len / indices buffers are slices of the persistent buffers
(aliased, never copied).  It is planned once, at construction, for the longest
keys each slot can read, so replays only need the buffers updated: with one query
per request the split-KV plan stays valid for shorter sequences (the extra KV
chunks are empty and merge as zero weight); verify windows (query_len > 1) plan
without split-KV, since the kernel's partial-output stride follows the runtime
length.  Padding requests read one key of ``scratch_page`` (which the engine
reserves) and no real KV; their output rows are garbage and ignored.

Speculative verify on chunked layers: a window of ``query_len`` tokens touches at
most two chunks.  Each request gets two slots with the same ``query_len`` rows:
the first reads from the previous chunk's start (used only when the window
straddles a boundary), the second from the last chunk's start; FlashInfer's causal
mask (bottom-right aligned) gives every row exactly its chunk's keys in the slot
of its own chunk, and ``verify_use_first`` picks that slot per row.  Uniform query
lengths are what the graph-stable tensor-core path needs; a ragged split of the
window would need a host plan per step.  See docs/gpu.md.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from chunklocal.kv_spec import chunk_size_of
from chunklocal.metadata import (
    MetadataBuffers,
    group_capacities,
    slot_page_limits,
    write_graph_step,
    write_graph_step_device,
    write_step,
)
from chunklocal.virtual_batches import validate_batch

_WORKSPACE_BYTES = 128 << 20
_workspaces: dict[torch.device, torch.Tensor] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    # Wrappers of every group run one after another on one stream: one float
    # workspace per device is enough.
    if device not in _workspaces:
        _workspaces[device] = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


def default_graph_batch_sizes(limit: int) -> tuple[int, ...]:
    """Powers of two up to ``limit``, and ``limit`` itself."""
    sizes = {1 << i for i in range(max(limit, 1).bit_length()) if 1 << i <= limit}
    return tuple(sorted(sizes | {limit}))


class EagerMetadata:
    """One step's planned wrappers, keyed by ``chunked`` (True / False)."""

    def __init__(self, wrappers: dict, num_tokens: int):
        self.wrappers, self.num_tokens = wrappers, num_tokens


class GraphMetadata:
    """Static per (B, query_len): wrappers aliasing the persistent buffers."""

    def __init__(self, batch_size: int, query_len: int, wrappers: dict, two_slots: dict,
                 use_first: torch.Tensor | None):
        self.batch_size, self.query_len = batch_size, query_len
        self.wrappers, self.two_slots, self.use_first = wrappers, two_slots, use_first


class _Kind:
    """Buffers and wrappers of one attention kind (chunked or global) of the group."""

    def __init__(self, chunk, capacity, backend):
        self.chunk = chunk
        self.buffers = MetadataBuffers(
            capacity, backend.block_size, device=backend.device, cuda_graphs=backend.cuda_graphs,
            name="chunked" if chunk else "global",
            verify_rows=max(backend.graph_batch_sizes, default=0) * (backend.verify_len or 0),
        )


class FlashInferBackend:
    """FlashInfer attention for one KV group (chunked, global, or merged)."""

    def __init__(self, spec, limits, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, cuda_graphs: bool = False, *,
                 graph_batch_sizes=None, verify_len: int | None = None,
                 scratch_page: int | None = None, sm_scale: float | None = None,
                 prefill_backend: str = "fa2"):
        import flashinfer  # noqa: F401  (fail here, not at the first step)

        self.spec, self.limits = spec, limits
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.block_size = spec.block_size
        if self.block_size != limits.block_size:
            raise ValueError(f"spec block_size {self.block_size} differs from the engine's "
                             f"{limits.block_size}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads {num_qo_heads} is not a multiple of "
                             f"num_kv_heads {num_kv_heads}")
        self.sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self.cuda_graphs = bool(cuda_graphs)
        self.prefill_backend = prefill_backend
        self.chunk = chunk_size_of(spec)
        n_limit = min(limits.max_num_seqs, limits.max_num_batched_tokens)
        if self.cuda_graphs:
            sizes = graph_batch_sizes or default_graph_batch_sizes(n_limit)
            self.graph_batch_sizes = tuple(sorted({int(b) for b in sizes}))
            if self.graph_batch_sizes[0] < 1 or self.graph_batch_sizes[-1] > n_limit:
                raise ValueError(f"graph batch sizes must lie in [1, {n_limit}], got "
                                 f"{self.graph_batch_sizes}")
            if scratch_page is None or scratch_page < 0:
                raise ValueError("cuda_graphs=True needs scratch_page: a KV page the engine "
                                 "reserves for padding rows")
        else:
            self.graph_batch_sizes = ()
        if verify_len is not None:
            if verify_len < 2 or (self.chunk and verify_len > self.chunk):
                raise ValueError(f"verify_len {verify_len} must be in [2, chunk size "
                                 f"{self.chunk}] (a window may touch at most two chunks)")
        self.verify_len = verify_len
        self.scratch_page = int(scratch_page or 0)
        self.graph_query_lens = (1,) + ((verify_len,) if verify_len and self.cuda_graphs else ())
        capacities = group_capacities(spec, limits, self.graph_batch_sizes, self.graph_query_lens)
        self._kinds = {chunked: _Kind(self.chunk if chunked else None, capacity, self)
                       for chunked, capacity in capacities.items()}
        self._make_eager_wrappers()
        self._graphs = {(b, q): self._make_graph(b, q)
                        for b in self.graph_batch_sizes for q in self.graph_query_lens}

    # -------------------------------------------------------------- wrappers
    def _plan_kwargs(self):
        return dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.sm_scale)

    def _make_eager_wrappers(self):
        import flashinfer

        for kind in self._kinds.values():
            ws = _workspace(self.device)
            kind.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                ws, "NHD", backend=self.prefill_backend)
            kind.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_tensor_cores=True)

    def _make_graph(self, batch_size: int, query_len: int) -> GraphMetadata:
        import flashinfer

        wrappers, two = {}, {}
        for chunked, kind in self._kinds.items():
            limits = slot_page_limits(kind.chunk, query_len, self.limits.max_model_len,
                                      self.block_size)
            two[chunked] = len(limits) == 2
            slots = batch_size * len(limits)
            gpu = kind.buffers.gpu
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                _workspace(self.device), "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=gpu["paged_kv_indptr"][: slots + 1],
                paged_kv_indices_buffer=gpu["paged_kv_indices"],
                paged_kv_last_page_len_buffer=gpu["paged_kv_last_page_len"][:slots])
            # Plan once for the longest keys every slot can read (see module doc).
            max_keys = np.minimum(np.array(limits) * self.block_size, self.limits.max_model_len)
            keys = np.tile(max_keys, batch_size)
            pages = -(-keys // self.block_size)
            indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(pages)]).astype(np.int32))
            last = torch.from_numpy((keys - (pages - 1) * self.block_size).astype(np.int32))
            wrapper.plan(indptr, torch.zeros(0, dtype=torch.int32), last, self.num_qo_heads,
                         self.num_kv_heads, self.head_dim, self.block_size,
                         q_len_per_req=query_len, disable_split_kv=query_len > 1,
                         non_blocking=False, **self._plan_kwargs())
            wrappers[chunked] = wrapper
        use_first = None
        if True in self._kinds and two.get(True):
            use_first = self._kinds[True].buffers.verify_use_first[: batch_size * query_len]
        return GraphMetadata(batch_size, query_len, wrappers, two, use_first)

    # ---------------------------------------------------------------- build
    def build(self, query_start_loc, seq_lens, block_table, *, graph_batch_size=None):
        """Host work for one step (see module doc); int numpy inputs [N+1], [N], [N, W]."""
        qsl, seq, table, query_lens = validate_batch(query_start_loc, seq_lens, block_table,
                                                     self.block_size)
        if qsl.size and qsl[0] != 0:
            raise ValueError(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
        # Gather pages from the caller's int32 table itself: no int64 copy of it.
        source = block_table.numpy() if isinstance(block_table, torch.Tensor) else block_table
        if isinstance(source, np.ndarray) and source.dtype == np.int32:
            table = source
        if graph_batch_size is not None:
            return self._build_graph(seq, table, query_lens, graph_batch_size)
        wrappers = {}
        decode_only = bool(query_lens.size) and bool((query_lens == 1).all())
        for chunked, kind in self._kinds.items():
            step = write_step(kind.buffers, qsl, seq, table, query_lens, kind.chunk)
            if step.num_batches == 0:
                wrappers[chunked] = None
                continue
            if decode_only:
                kind.decode.plan(step.paged_kv_indptr, step.paged_kv_indices,
                                 step.paged_kv_last_page_len, self.num_qo_heads,
                                 self.num_kv_heads, self.head_dim, self.block_size,
                                 **self._plan_kwargs())
                wrappers[chunked] = kind.decode
            else:
                kind.prefill.plan(step.qo_indptr, step.paged_kv_indptr, step.paged_kv_indices,
                                  step.paged_kv_last_page_len, self.num_qo_heads,
                                  self.num_kv_heads, self.head_dim, self.block_size,
                                  causal=True, **self._plan_kwargs())
                wrappers[chunked] = kind.prefill
            kind.buffers.mark_consumed(step)
        return EagerMetadata(wrappers, int(qsl[-1]) if qsl.size else 0)

    def _graph(self, batch_size: int, query_len: int) -> GraphMetadata:
        graph = self._graphs.get((batch_size, query_len))
        if graph is None:
            raise ValueError(f"no CUDA-graph layout for batch size {batch_size} and query "
                             f"length {query_len}; captured sizes {self.graph_batch_sizes}, "
                             f"query lengths {self.graph_query_lens}")
        return graph

    def _build_graph(self, seq, table, query_lens, batch_size):
        num_reqs = seq.shape[0]
        query_len = int(query_lens[0]) if num_reqs else 1
        bad = np.flatnonzero(query_lens != query_len)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"request {i}: a graph step needs equal query lengths, got "
                             f"{int(query_lens[i])} and {query_len}")
        if num_reqs > batch_size:
            raise ValueError(f"{num_reqs} requests do not fit graph batch size {batch_size}")
        graph = self._graph(batch_size, query_len)
        padded = np.zeros(batch_size, np.int64)
        padded[:num_reqs] = seq
        padded_table = np.zeros((batch_size, table.shape[1]), np.int32)
        padded_table[:num_reqs] = table
        for chunked, kind in self._kinds.items():
            step, mask = write_graph_step(kind.buffers, padded, padded_table, query_len,
                                          kind.chunk, graph.two_slots[chunked], self.scratch_page)
            kind.buffers.copy_to_device(step)
            if mask is not None:
                graph.use_first.copy_(torch.from_numpy(mask), non_blocking=True)
        return graph

    def build_on_device(self, seq_lens: torch.Tensor, block_table: torch.Tensor, *,
                        graph_batch_size: int, query_len: int = 1) -> GraphMetadata:
        """Device-side metadata for a padded graph step: capturable, no host sync.

        ``seq_lens`` [B] int32 (0 for padding requests), ``block_table`` [B, W] int32,
        both on the backend's device.
        """
        graph = self._graph(graph_batch_size, query_len)
        if seq_lens.shape != (graph_batch_size,) or block_table.shape[0] != graph_batch_size:
            raise ValueError(f"seq_lens {tuple(seq_lens.shape)} / block_table "
                             f"{tuple(block_table.shape)} must have {graph_batch_size} rows")
        for chunked, kind in self._kinds.items():
            write_graph_step_device(kind.buffers, seq_lens, block_table, query_len, kind.chunk,
                                    graph.two_slots[chunked], self.scratch_page,
                                    self.limits.max_model_len)
        return graph

    # -------------------------------------------------------------- forward
    def forward(self, metadata, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, scale: float, *, chunked: bool | None = None,
                out: torch.Tensor | None = None):
        """q [tokens, Hq, D]; caches [num_pages, block_size, Hkv, D] -> [tokens, Hq, D].

        ``chunked`` picks the layer kind in a merged group (required there); ``out``
        (optional, q's shape and dtype) receives the result.
        """
        if chunked is None:
            if len(self._kinds) != 1:
                raise ValueError("this KV group has chunked and global layers: pass "
                                 "chunked=True or chunked=False")
            chunked = next(iter(self._kinds))
        if chunked not in self._kinds:
            raise ValueError(f"this KV group has no {'chunked' if chunked else 'global'} layers")
        q_scale = None if scale == self.sm_scale else scale / self.sm_scale
        wrapper = metadata.wrappers[chunked]
        if wrapper is None:
            return q.new_empty(q.shape) if out is None else out
        if isinstance(metadata, GraphMetadata) and metadata.two_slots[chunked]:
            b, n = metadata.batch_size, metadata.query_len
            pair = q.view(b, 1, n, *q.shape[1:]).expand(b, 2, n, *q.shape[1:])
            pair_out = wrapper.run(pair.reshape(2 * b * n, *q.shape[1:]), (k_cache, v_cache),
                                   q_scale=q_scale).view(b, 2, n, *q.shape[1:])
            pick = metadata.use_first.view(b, n, 1, 1)
            result = torch.where(pick, pair_out[:, 0], pair_out[:, 1]).reshape(q.shape)
            return result if out is None else out.copy_(result)
        return wrapper.run(q, (k_cache, v_cache), q_scale=q_scale, out=out)
