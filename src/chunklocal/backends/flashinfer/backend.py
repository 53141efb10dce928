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
    md = backend.capture_step(B, query_len)  # what the graph captures (all padding)
    out = backend.forward(md, q, k_cache, v_cache, scale)   # q: [B * query_len, Hq, D]
    # per step, before each replay (host metadata, 3 non-blocking copies into the
    # same persistent buffers md's wrappers alias):
    backend.build(qsl, seq_lens, block_table, graph_batch_size=B)

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

import os
from typing import Any

import numpy as np
import torch

from chunklocal._validate import as_bool, cdiv, raise_first
from chunklocal.backends.base import EngineLimits, Kind, pick_kind
from chunklocal.backends.flashinfer.buffers import MetadataBuffers, write_step
from chunklocal.backends.flashinfer.own_keys import (
    GatherBuffers,
    OwnKeys,
    plan_own_keys,
    run_own_keys,
)
from chunklocal.backends.flashinfer.ragged import PinnedArrays
from chunklocal.bounds.sizing import (
    backend_capacities,
    gathered_key_capacity,
    slot_page_limits,
)
from chunklocal.kv_quant import is_fp8
from chunklocal.kv_spec import FullAttentionSpec, chunk_size_of, softmax_scale
from chunklocal.virtual_batches import validate_batch

_WORKSPACE_BYTES = 128 << 20
#: The switch read at import: on since the sixteenth session's serve A/B (4-layer Scout,
#: 1k prompts, 64 new tokens, piecewise graphs on; out tok/s 6,362 -> 7,690 at 64 clients
#: and 6,679 -> 9,806 at 256; BENCHMARKS.md).  ``CHUNKLOCAL_OVERLAP_EAGER=0`` collects each
#: eager step before the next launches (the alternating wrappers are used either way).
OVERLAP_EAGER = os.environ.get("CHUNKLOCAL_OVERLAP_EAGER", "1") == "1"
#: Decode graphs (one query a request) re-planned before each replay for the step's own
#: lengths (``CHUNKLOCAL_GRAPH_REPLAN=1``; ``switch_ab --switches graph_replan``).  Planned
#: once, for the longest keys a slot can read, FlashInfer sizes the KV tiles from those
#: lengths: with a 131,072-token ``max_model_len`` a 1k context at batch 1 is one tile a KV
#: head, and the H200 ran a chunked and a global layer's graph step in 0.520 ms against
#: 0.310 planned for 1k keys (27th session, BENCHMARKS.md).  Under CUDA graphs FlashInfer
#: 0.7.2 keeps split-KV on and derives the grid, the buffers' offsets and the merge's launch
#: from the batch size alone, so a re-plan changes only what the captured kernels read from
#: its device buffer (the chunk size and the tiles' indices).  Its host staging is the
#: wrapper's pinned buffer, copied by a queued copy: each kind alternates two staging
#: buffers (shared by its graph sizes), as the eager wrappers alternate, because the next
#: step may be planned before the last one ran.  Off until a GPU A/B and the graph tests.
GRAPH_REPLAN = os.environ.get("CHUNKLOCAL_GRAPH_REPLAN", "0") == "1"
#: Eager prefill and mixed steps read the step's own keys from its K/V (ragged) and only
#: the earlier keys from the paged cache, merged by log-sum-exp (:mod:`.ragged`;
#: ``CHUNKLOCAL_RAGGED_OWN_KEYS=1``).  The ragged kernel is FlashInfer's ``"auto"``, FA3's
#: TMA-fed kernel on sm_90: exact under every compute-sanitizer tool but racecheck, where
#: the paged FA3 kernel is not (docs/fa3-analysis.md).  The H200 prototype
#: (``benchmarks.prefill_ragged``, 27th session): 76.4% of the matmul rate on a
#: 36,000-token prompt against 44.9% for the paged FA2 default, but 1.03x slower than
#: paged FA3 for 8 x 8192 behind prefixes (the merge).  16-bit caches only (an FP8 cache
#: holds the keys rounded; the step's own would not be).  On by default since the 28th
#: session: on an H100, 12 of Scout FP8's layers, the prefill step's attention went from 39%
#: to 82% of the matmul rate and the 8k prompt from 46% to 62% of its FLOP floor
#: (``benchmarks.prefill_profile``, BENCHMARKS.md), with the kernel and engine GPU tests
#: passing; ``CHUNKLOCAL_RAGGED_OWN_KEYS=0`` turns it off.
RAGGED_OWN_KEYS = os.environ.get("CHUNKLOCAL_RAGGED_OWN_KEYS", "1") == "1"
#: With :data:`RAGGED_OWN_KEYS`, the earlier keys of segments of at least
#: :data:`GATHER_MIN_ROWS` queries are copied from the pages into a contiguous buffer in
#: blocks and read by the ragged kernel too (:func:`.ragged.split_earlier`;
#: ``CHUNKLOCAL_RAGGED_EARLIER=1``).  Why: those keys are most of a long prompt's later
#: steps on global layers (a 1M-token prompt's: all but 8k of 1M), and the paged kernel
#: that reads them now (FA2) ran at about 45% of the matmul rate where the ragged FA3
#: kernel ran at 76-82% (27th and 28th sessions); the copy is one read and write of K and V,
#: small beside 2 x 128+ rows of FLOPs per key.  On by default since the 29th session
#: (an H100, 12 of Scout FP8's layers, alternated twice: a 32k prompt 0.934x, 64k 0.865x
#: of the paged reads; its kernel, memory and engine GPU tests passed);
#: ``CHUNKLOCAL_RAGGED_EARLIER=0`` turns it off.
RAGGED_EARLIER = os.environ.get("CHUNKLOCAL_RAGGED_EARLIER", "1") == "1"
#: Queries a segment needs for its earlier keys to be gathered: one FA3 tile of rows.
#: Shorter segments (decodes in a mixed step) read each key once either way, and the copy
#: would double that traffic.
GATHER_MIN_ROWS = 128
#: Gathered blocks a kind's step may use (each one more ragged wrapper per eager parity,
#: made with the backend: FlashInfer's 8 MiB of plan buffers on the device, 8 MiB pinned);
#: beyond ``GATHER_MAX_BLOCKS * gathered_key_capacity`` keys (128k for Scout at 8k steps)
#: the rest of a step's earlier keys stay paged (:func:`.ragged.split_earlier`).
GATHER_MAX_BLOCKS = 4
RAGGED_KERNEL = "auto"
_workspaces: dict[torch.device, torch.Tensor] = {}
_NO_INDICES = torch.zeros(0, dtype=torch.int32)


def _workspace(device: torch.device) -> torch.Tensor:
    # Wrappers of every group run one after another on one stream: one float
    # workspace per device is enough.
    if device not in _workspaces:
        _workspaces[device] = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


class EagerMetadata:
    """One step's planned wrappers, keyed by layer kind."""

    def __init__(self, wrappers: dict, num_tokens: int):
        self.wrappers, self.num_tokens = wrappers, num_tokens


class GraphMetadata:
    """Static per (B, query_len): wrappers aliasing the persistent buffers.  ``use_first``
    [B * query_len] picks each row's slot where ``two_slots[kind]`` (chunked verify);
    an empty tensor where no kind has two slots.  ``longest[kind]``: the (indptr,
    last_page_len) host tensors of the plan for the longest keys; ``replanned``: the kinds
    whose wrapper holds a plan for an earlier step's lengths (:data:`GRAPH_REPLAN`)."""

    def __init__(self, batch_size: int, query_len: int, wrappers: dict, two_slots: dict,
                 use_first: torch.Tensor, longest: dict):
        self.batch_size, self.query_len = batch_size, query_len
        self.wrappers, self.two_slots, self.use_first = wrappers, two_slots, use_first
        self.longest = longest
        self.replanned: set[Kind] = set()


class _KindState:
    """Buffers and eager wrappers of one attention kind (chunked or global) of the group.

    Two wrappers of each type, used by alternate eager steps: ``plan()`` stages its
    schedule in the wrapper's pinned buffer and queues the copy to the device, so a second
    ``plan()`` on the same wrapper could overwrite the staging before the first copy ran.
    With async scheduling the next step is planned while the last one is still queued
    (engine/overlap.py), and collected before the one after it is planned: two suffice."""

    def __init__(self, kind: Kind, chunk_size, capacity, backend: FlashInferBackend,
                 verify_rows: int):
        import flashinfer

        self.chunk_size = chunk_size
        self.buffers = MetadataBuffers(
            capacity, backend.block_size, device=backend.device, cuda_graphs=backend.cuda_graphs,
            name=kind.value, verify_rows=verify_rows)
        ws = _workspace(backend.device)
        self.prefill = tuple(flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            ws, "NHD", backend=backend.prefill_backend) for _ in range(2))
        self.decode = tuple(flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_tensor_cores=True) for _ in range(2))
        self._own_keys: list | None = None  # RAGGED_OWN_KEYS' wrappers, made at first use
        self._blocks: tuple[list, list] = ([], [])  # RAGGED_EARLIER's, per parity, grown
        self._backend_name = backend.prefill_backend
        #: GRAPH_REPLAN's two host staging buffers (made at the first re-plan) and the next.
        self.replan_staging: tuple[torch.Tensor, torch.Tensor] | None = None
        self.replan_parity = 0

    def own_keys(self, parity: int) -> tuple:
        """(ragged, paged) wrappers and the host staging of eager step ``parity`` for
        :data:`RAGGED_OWN_KEYS`."""
        import flashinfer

        if self._own_keys is None:
            ws = _workspace(self.buffers.device)
            pin = self.buffers.device.type == "cuda"
            self._own_keys = [
                (flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD",
                                                                 backend=RAGGED_KERNEL),
                 flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD",
                                                                backend=self._backend_name),
                 PinnedArrays(pin))
                for _ in range(2)]
        return self._own_keys[parity]

    def block_wrapper(self, parity: int, index: int):
        """Ragged wrapper of gathered block ``index`` of eager step ``parity``."""
        import flashinfer

        made = self._blocks[parity]
        while len(made) <= index:
            made.append(flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                _workspace(self.buffers.device), "NHD", backend=RAGGED_KERNEL))
        return made[index]

    def staging(self, wrapper) -> torch.Tensor:
        """The host staging buffer this re-plan of a graph ``wrapper`` writes (alternating)."""
        staging = self.replan_staging
        if staging is None:
            first = wrapper._pin_memory_int_workspace_buffer
            staging = self.replan_staging = (
                torch.empty(first.shape, dtype=first.dtype, pin_memory=first.is_pinned()),
                torch.empty(first.shape, dtype=first.dtype, pin_memory=first.is_pinned()))
        buf, self.replan_parity = staging[self.replan_parity], self.replan_parity ^ 1
        return buf


class FlashInferBackend:
    """FlashInfer attention for one KV group (chunked, global, or merged)."""

    def __init__(self, spec: FullAttentionSpec, limits: EngineLimits, num_q_heads: int,
                 num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, cuda_graphs: bool = False, *,
                 graph_batch_sizes=None, verify_len: int | None = None,
                 scratch_page: int | None = None, sm_scale: float | None = None,
                 prefill_backend: str = "fa2"):
        import flashinfer  # fail here, not at the first step

        self._merge_state = flashinfer.merge_state

        self.spec, self.limits = spec, limits
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.block_size = spec.block_size
        if self.block_size != limits.block_size:
            raise ValueError(f"spec block_size {self.block_size} differs from the engine's "
                             f"{limits.block_size}")
        if (num_kv_heads, head_dim) != (spec.num_kv_heads, spec.head_dim):
            raise ValueError(f"num_kv_heads {num_kv_heads} / head_dim {head_dim} differ from "
                             f"the spec's {spec.num_kv_heads} / {spec.head_dim}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of "
                             f"num_kv_heads {num_kv_heads}")
        self.sm_scale = float(sm_scale) if sm_scale is not None else softmax_scale(head_dim)
        self.cuda_graphs = as_bool(cuda_graphs, "cuda_graphs")
        self.prefill_backend = prefill_backend
        self.chunk_size = chunk_size_of(spec)
        if self.cuda_graphs and (scratch_page is None or scratch_page < 0):
            raise ValueError("cuda_graphs=True needs scratch_page: a KV page the engine "
                             "reserves for padding rows")
        if verify_len is not None:
            if verify_len < 2 or (self.chunk_size and verify_len > self.chunk_size):
                raise ValueError(f"verify_len {verify_len} must be in [2, chunk size "
                                 f"{self.chunk_size}] (a window may touch at most two chunks)")
        self.verify_len = verify_len
        self.scratch_page = int(scratch_page or 0)
        sizes = backend_capacities(spec, limits, self.cuda_graphs, verify_len, graph_batch_sizes)
        self.graph_batch_sizes, self.graph_query_lens = sizes.graph_batch_sizes, \
            sizes.graph_query_lens
        self._kinds = {kind: _KindState(kind, self.chunk_size if kind is Kind.CHUNKED else None,
                                        capacity, self, sizes.verify_rows)
                       for kind, capacity in sizes.capacities.items()}
        self._graphs = {(b, q): self._make_graph(b, q)
                        for b in self.graph_batch_sizes for q in self.graph_query_lens}
        self._eager_parity = 0  # which of each kind's two eager wrappers the next step plans
        #: RAGGED_EARLIER's K and V blocks (bounds/sizing.gathered_key_capacity), made here
        #: when the path is on so the memory profile's step counts them.
        self.gather = GatherBuffers(gathered_key_capacity(limits), num_kv_heads, head_dim,
                                    dtype, self.device)
        if RAGGED_OWN_KEYS and RAGGED_EARLIER and not is_fp8(spec.dtype):
            self.gather.get()
            for state in self._kinds.values():
                for parity in (0, 1):
                    state.block_wrapper(parity, GATHER_MAX_BLOCKS - 1)
        #: Eager steps may be launched before the previous one is collected (two wrappers
        #: per kind, see _KindState); ``CHUNKLOCAL_OVERLAP_EAGER=0`` makes the engine
        #: collect each eager step first.
        self.overlaps_eager_steps = OVERLAP_EAGER

    # -------------------------------------------------------------- wrappers
    def _plan_kwargs(self):
        # FP8 pages (kv_cache_dtype="fp8"): e4m3 K/V, queries in the model's dtype
        kv = self.spec.dtype if is_fp8(self.spec.dtype) else self.dtype
        return dict(q_data_type=self.dtype, kv_data_type=kv, sm_scale=self.sm_scale)

    def _make_graph(self, batch_size: int, query_len: int) -> GraphMetadata:
        import flashinfer

        wrappers, two, longest = {}, {}, {}
        for kind, state in self._kinds.items():
            limits = slot_page_limits(state.chunk_size, query_len, self.limits.max_model_len,
                                      self.block_size)
            two[kind] = len(limits) == 2
            slots = batch_size * len(limits)
            gpu = state.buffers.gpu
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                _workspace(self.device), "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=gpu["paged_kv_indptr"][: slots + 1],
                paged_kv_indices_buffer=gpu["paged_kv_indices"],
                paged_kv_last_page_len_buffer=gpu["paged_kv_last_page_len"][:slots])
            # Plan once for the longest keys every slot can read (see module doc).
            max_keys = np.minimum(np.array(limits) * self.block_size, self.limits.max_model_len)
            keys = np.tile(max_keys, batch_size)
            pages = cdiv(keys, self.block_size)
            pin = self.device.type == "cuda"  # kept: a later plan copies from them again
            indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(pages)]).astype(np.int32))
            last = torch.from_numpy((keys - (pages - 1) * self.block_size).astype(np.int32))
            longest[kind] = (indptr.pin_memory(), last.pin_memory()) if pin else (indptr, last)
            wrapper.plan(indptr, _NO_INDICES, last, self.num_q_heads,
                         self.num_kv_heads, self.head_dim, self.block_size,
                         q_len_per_req=query_len, disable_split_kv=query_len > 1,
                         non_blocking=False, **self._plan_kwargs())
            wrappers[kind] = wrapper
        use_first = torch.zeros(0, dtype=torch.bool, device=self.device)
        if two.get(Kind.CHUNKED):
            use_first = self._kinds[Kind.CHUNKED].buffers.verify_use_first[
                : batch_size * query_len]
        return GraphMetadata(batch_size, query_len, wrappers, two, use_first, longest)

    # ---------------------------------------------------------------- build
    def build(self, query_start_loc, seq_lens, block_table, *, graph_batch_size=None):
        """Host work for one step (see module doc); int numpy inputs [N+1], [N], [N, W].

        The batch is validated here, once; an int32 table is used as it is (no copy).
        """
        qsl, seq_lens, block_table, query_lens = validate_batch(
            query_start_loc, seq_lens, block_table, self.block_size)
        if qsl.size and qsl[0] != 0:
            raise ValueError(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
        if graph_batch_size is not None:
            query_len = int(query_lens[0]) if query_lens.size else 1
            raise_first(query_lens != query_len, lambda i: (
                f"request {i}: a graph step needs equal query lengths, got "
                f"{int(query_lens[i])} and {query_len}"))
            return self._build_graph(seq_lens, block_table, query_len, graph_batch_size)
        wrappers: dict[Kind, Any] = {}
        decode_only = bool(query_lens.size) and bool((query_lens == 1).all())
        parity, self._eager_parity = self._eager_parity, self._eager_parity ^ 1
        own_keys = RAGGED_OWN_KEYS and not decode_only and not is_fp8(self.spec.dtype)
        for kind, state in self._kinds.items():
            if own_keys:
                wrappers[kind] = plan_own_keys(
                    self, state, parity, qsl, seq_lens, block_table,
                    (self.gather.keys, GATHER_MIN_ROWS, GATHER_MAX_BLOCKS)
                    if RAGGED_EARLIER else None)
                continue
            step = write_step(state.buffers, qsl, seq_lens, block_table, query_lens,
                              state.chunk_size)
            if step.num_batches == 0:
                wrappers[kind] = None
                continue
            if decode_only:
                wrapper = state.decode[parity]
                wrapper.plan(step.paged_kv_indptr, step.paged_kv_indices,
                             step.paged_kv_last_page_len, self.num_q_heads, self.num_kv_heads,
                             self.head_dim, self.block_size, **self._plan_kwargs())
            else:
                wrapper = state.prefill[parity]
                wrapper.plan(step.qo_indptr, step.paged_kv_indptr, step.paged_kv_indices,
                             step.paged_kv_last_page_len, self.num_q_heads, self.num_kv_heads,
                             self.head_dim, self.block_size, causal=True,
                             **self._plan_kwargs())
            wrappers[kind] = wrapper
            state.buffers.mark_consumed(step)
        return EagerMetadata(wrappers, int(qsl[-1]) if qsl.size else 0)

    def _graph(self, batch_size: int, query_len: int) -> GraphMetadata:
        graph = self._graphs.get((batch_size, query_len))
        if graph is None:
            raise ValueError(f"no CUDA-graph layout for batch size {batch_size} and query "
                             f"length {query_len}; captured sizes {self.graph_batch_sizes}, "
                             f"query lengths {self.graph_query_lens}")
        return graph

    def capture_step(self, batch_size: int, query_len: int) -> GraphMetadata:
        """The (B, q) graph's metadata with every request padding (scratch page only)."""
        if not self.cuda_graphs:
            raise ValueError("capture_step needs a backend built with cuda_graphs=True")
        return self._build_graph(np.zeros(0, np.int64), np.zeros((0, 1), np.int32), query_len,
                                 batch_size, replan=False)

    def _build_graph(self, seq_lens, block_table, query_len: int, batch_size: int, *,
                     replan: bool = True):
        num_reqs = seq_lens.shape[0]
        if num_reqs > batch_size:
            raise ValueError(f"{num_reqs} requests do not fit graph batch size {batch_size}")
        graph = self._graph(batch_size, query_len)
        padded_seq_lens = np.zeros(batch_size, np.int64)
        padded_seq_lens[:num_reqs] = seq_lens
        padded_table = np.zeros((batch_size, max(block_table.shape[1], 1)), np.int32)
        padded_table[:num_reqs, :block_table.shape[1]] = block_table
        for kind, state in self._kinds.items():
            step, mask = state.buffers.write_graph_step(
                padded_seq_lens, padded_table, query_len, state.chunk_size,
                graph.two_slots[kind], self.scratch_page)
            if kind in graph.replanned and not (replan and GRAPH_REPLAN):
                # planned for an earlier step's lengths, and not re-planned now (the switch
                # went off, or a capture): back to the longest keys first, since that plan
                # copies its lengths into the aliased buffers the step's copy then refreshes
                self._plan_graph(graph, kind, state, *graph.longest[kind])
                graph.replanned.discard(kind)
            state.buffers.copy_to_device(step)
            if mask is not None:
                graph.use_first.copy_(torch.from_numpy(mask), non_blocking=True)
            if replan and GRAPH_REPLAN and query_len == 1:
                self._plan_graph(graph, kind, state, step.paged_kv_indptr,
                                 step.paged_kv_last_page_len)
                graph.replanned.add(kind)
        return graph

    def _plan_graph(self, graph: GraphMetadata, kind: Kind, state: _KindState, indptr,
                    last_page_len) -> None:
        """Plan a decode graph's wrapper again for these lengths (host tensors that stay as
        they are until the plan's copies ran): :data:`GRAPH_REPLAN`.  The indices are in
        the aliased buffer already: none passed."""
        wrapper = graph.wrappers[kind]
        wrapper._pin_memory_int_workspace_buffer = state.staging(wrapper)
        wrapper.plan(indptr, _NO_INDICES, last_page_len, self.num_q_heads, self.num_kv_heads,
                     self.head_dim, self.block_size, q_len_per_req=1, non_blocking=True,
                     **self._plan_kwargs())

    # -------------------------------------------------------------- forward
    def forward(self, metadata, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, scale: float, *, kind: Kind | None = None,
                out: torch.Tensor | None = None, k_scale: float | None = None,
                v_scale: float | None = None, k: torch.Tensor | None = None,
                v: torch.Tensor | None = None):
        """q [tokens, Hq, D]; caches [num_pages, block_size, Hkv, D] -> [tokens, Hq, D].

        ``kind`` picks the layer kind in a merged group (required there); ``out``
        (optional, q's shape and dtype) receives the result.  ``k_scale`` / ``v_scale``:
        FP8 pages' scales, passed to ``run()`` (0.7.2 folds k_scale into sm_scale and
        multiplies the output by v_scale).  ``k`` / ``v`` [tokens, Hkv, D]: the step's own
        keys and values (as written to the cache), read on the ragged path.
        """
        if kind not in self._kinds:  # the engine always passes a kind its group has
            kind = pick_kind(self._kinds, kind)
        q_scale = None if scale == self.sm_scale else scale / self.sm_scale
        fp8 = {} if k_scale is None and v_scale is None else dict(
            k_scale=None if k_scale is None else float(k_scale),
            v_scale=None if v_scale is None else float(v_scale))
        wrapper = metadata.wrappers[kind]
        if wrapper is None:
            return q.new_empty(q.shape) if out is None else out
        if isinstance(wrapper, OwnKeys):
            if k is None or v is None:
                raise ValueError("this step reads its own keys from k and v (the ragged "
                                 "path, CHUNKLOCAL_RAGGED_OWN_KEYS): pass them")
            o = run_own_keys(wrapper, q, k, v, k_cache, v_cache, q_scale, self._merge_state,
                             self.gather)
            return o if out is None else out.copy_(o)
        if isinstance(metadata, GraphMetadata) and metadata.two_slots[kind]:
            b, n = metadata.batch_size, metadata.query_len
            pair = q.view(b, 1, n, *q.shape[1:]).expand(b, 2, n, *q.shape[1:])
            pair_out = wrapper.run(pair.reshape(2 * b * n, *q.shape[1:]), (k_cache, v_cache),
                                   q_scale=q_scale, **fp8).view(b, 2, n, *q.shape[1:])
            pick = metadata.use_first.view(b, n, 1, 1)
            result = torch.where(pick, pair_out[:, 0], pair_out[:, 1]).reshape(q.shape)
            return result if out is None else out.copy_(result)
        return wrapper.run(q, (k_cache, v_cache), q_scale=q_scale, out=out, **fp8)
