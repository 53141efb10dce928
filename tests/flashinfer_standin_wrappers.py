"""The two paged-KV wrappers of the FlashInfer 0.7.2.post1 stand-in (see flashinfer_standin).

Parameter lists are 0.7.2.post1's (names, order, defaults, keyword-only markers; the
annotations dropped).  Checks and math live in ``flashinfer_standin_core``.
"""

from __future__ import annotations

import warnings

import flashinfer_standin_core as core
import torch

_PREFILL_BACKENDS = ("auto", "fa2", "fa3")
_DECODE_BACKENDS = ("auto", "fa2", "fa3")
# _BATCH_DECODE_PLAN_LEGACY_POS_ARGS of flashinfer/decode.py.
_DECODE_LEGACY_POSITIONAL = (
    "pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type",
    "o_data_type", "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking",
    "block_tables", "seq_lens", "fixed_split_size", "disable_split_kv", "q_len_per_req")



class BatchPrefillWithPagedKVCacheWrapper(core.PagedWrapper):
    """Causal / full prefill (append) attention over a paged NHD KV cache."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend="auto", jit_args=None, jit_kwargs=None, variant_owns_mask=False):
        core.check_workspace(float_workspace_buffer)
        core.check_layout(kv_layout)
        if variant_owns_mask and backend != "fa2":
            raise ValueError("variant_owns_mask is only supported on the fa2 backend")
        core.refuse(custom_mask_buf=(custom_mask_buf, None),
                    mask_indptr_buf=(mask_indptr_buf, None), jit_args=(jit_args, None),
                    jit_kwargs=(jit_kwargs, None), variant_owns_mask=(variant_owns_mask, False))
        core.check_backend(backend, _PREFILL_BACKENDS)
        self.device = float_workspace_buffer.device
        self._graph_buffers(use_cuda_graph, {
            "qo_indptr_buf": qo_indptr_buf, "paged_kv_indptr_buf": paged_kv_indptr_buf,
            "paged_kv_indices_buf": paged_kv_indices_buf,
            "paged_kv_last_page_len_buf": paged_kv_last_page_len_buf})
        self._fixed_batch_size = 0
        if use_cuda_graph:
            self._fixed_batch_size = len(qo_indptr_buf) - 1
            if len(paged_kv_indptr_buf) != self._fixed_batch_size + 1:
                raise ValueError("The length of paged_kv_indptr_buf should be batch_size + 1.")
            if len(paged_kv_last_page_len_buf) != self._fixed_batch_size:
                raise ValueError(
                    "The length of paged_kv_last_page_len_buf should be batch_size.")
        self._qo_indptr_buf, self._paged_kv_indptr_buf = qo_indptr_buf, paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf
        self._max_total_num_rows = None
        self._backend = backend

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, prefix_len_ptr=None,
             token_pos_in_items_ptr=None, token_pos_in_items_len=0, max_item_len_ptr=None,
             seq_lens=None, seq_lens_q=None, block_tables=None, max_token_per_sequence=None,
             max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False,
             uniform_q_len=None):
        # Ignored as on the fa2 path (hints, or RoPE parameters with no RoPE): non_blocking,
        # rope_scale, rope_theta, max_token_per_sequence, max_sequence_kv, fixed_split_size,
        # disable_split_kv, uniform_q_len.
        core.check_prefill_plan(locals(), page_size, "block_tables")
        sm_scale = core.check_scalar("sm_scale", sm_scale)
        q_dtype, kv_dtype, o_dtype = core.plan_dtypes(q_data_type, kv_data_type, o_data_type)
        qo = core.int32_vector("qo_indptr", qo_indptr)
        indptr = core.int32_vector("paged_kv_indptr", paged_kv_indptr)
        indices = core.int32_vector("paged_kv_indices", paged_kv_indices)
        last = core.int32_vector("paged_kv_last_page_len", paged_kv_last_page_len)
        batch_size = len(qo) - 1
        if len(indptr) != batch_size + 1:
            raise ValueError(f"paged_kv_indptr has {len(indptr)} entries, qo_indptr "
                             f"{len(qo)}: both must be batch_size + 1")
        total_rows = core.check_qo_indptr(qo)[-1]
        if self._use_cuda_graph:
            if batch_size != self._fixed_batch_size:
                raise ValueError(
                    "The batch size should be fixed during the lifecycle of the wrapper in "
                    f"cuda graph mode, the runtime batch size {batch_size} mismatches the "
                    f"batch size {self._fixed_batch_size}  set during initialization.")
            if len(indices) > len(self._paged_kv_indices_buf):
                raise ValueError(
                    "The length of paged_kv_indices exceeds the allocated buffer size.")
            if self._max_total_num_rows is not None and total_rows > self._max_total_num_rows:
                raise ValueError(
                    f"The total number of rows in qo_indptr {total_rows} in cuda graph mode "
                    "cannot exceed the number of rows set during initialization "
                    f"{self._max_total_num_rows}.")
            core.check_metadata(indptr, len(self._paged_kv_indices_buf), last, page_size,
                                exact=False)
            if self._max_total_num_rows is None:
                self._max_total_num_rows = total_rows
        else:
            core.check_metadata(indptr, len(indices), last, page_size, exact=True)
        self._store(qo, indptr, indices, last, page_size)
        self._plan = dict(q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype,
                          num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim_qk, page_size=page_size, causal=causal,
                          sm_scale=sm_scale, rows=total_rows, device=self.device)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse=False, lse_base="log2", lse_layout="NH", enable_pdl=None,
            window_left=None, sinks=None, kv_cache_sf=None,
            skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None,
            uses_spcompress=None):
        plan = self._require_plan()
        if lse_base not in ("log2", "ln"):
            raise ValueError(f"lse_base must be 'log2' or 'ln', got {lse_base!r}")
        if lse_layout not in ("NH", "HN"):
            raise ValueError(f"lse_layout must be 'NH' or 'HN', got {lse_layout!r}")
        self._check_run_options(
            args, lse, return_lse, window_left, lse_ok=True, sinks=sinks,
            kv_cache_sf=kv_cache_sf,
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
            use_fp16_softmax=use_fp16_softmax, uses_spcompress=uses_spcompress)
        if return_lse:
            core.refuse(lse_base=(lse_base, "log2"), lse_layout=(lse_layout, "NH"))
        k_cache, v_cache = core.unpack_cache(paged_kv_cache, plan)
        core.check_q(q, plan, plan["rows"])
        core.check_out(out, q, plan["o_dtype"])
        if self._use_cuda_graph:
            qo = core.check_qo_indptr(self._qo_indptr_buf, "qo_indptr_buf")
            if qo[-1] > q.shape[0]:
                raise ValueError(f"qo_indptr_buf[-1] = {qo[-1]} exceeds q's {q.shape[0]} rows")
        else:
            qo = self._qo
        indptr, indices, last = self._metadata(k_cache.shape[0])
        scale = core.softmax_scale(plan, q_scale, k_scale)
        o, row_lse = core.attention(q, k_cache, v_cache, qo, indptr, indices, last,
                                    plan["causal"], scale, with_lse=True)
        result = core.finish(o, v_scale, plan["o_dtype"], out)
        return (result, row_lse) if return_lse else result


class BatchDecodeWithPagedKVCacheWrapper(core.PagedWrapper):
    """Decode attention: q_len_per_req rows per request (causal, bottom-right, when > 1)."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        core.check_workspace(float_workspace_buffer)
        core.check_layout(kv_layout)
        core.refuse(jit_args=(jit_args, None))
        core.check_backend(backend, _DECODE_BACKENDS)
        self.device = float_workspace_buffer.device
        self._use_tensor_cores = core.check_bool("use_tensor_cores", use_tensor_cores)
        self._graph_buffers(use_cuda_graph, {
            "paged_kv_indptr_buffer": paged_kv_indptr_buffer,
            "paged_kv_indices_buffer": paged_kv_indices_buffer,
            "paged_kv_last_page_len_buffer": paged_kv_last_page_len_buffer})
        self._fixed_batch_size = 0
        if use_cuda_graph:
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != self._fixed_batch_size + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        self._backend = backend
        self._q_len_per_req = None
        self._planned_kv_lens = None
        # 0.7.2's host staging of the plan (plan() writes it, then queues its copy)
        self._pin_memory_int_workspace_buffer = torch.empty(64, dtype=torch.uint8)

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *deprecated_positional_args, **kwargs):
        if deprecated_positional_args:
            if len(deprecated_positional_args) > len(_DECODE_LEGACY_POSITIONAL):
                raise TypeError("BatchDecodeWithPagedKVCacheWrapper.plan() accepts at most "
                                f"{len(_DECODE_LEGACY_POSITIONAL)} deprecated optional "
                                "positional arguments after page_size")
            for name, value in zip(_DECODE_LEGACY_POSITIONAL, deprecated_positional_args,
                                   strict=False):
                if name in kwargs:
                    raise TypeError("BatchDecodeWithPagedKVCacheWrapper.plan() got multiple "
                                    f"values for argument {name!r}")
                kwargs[name] = value
            warnings.warn("Passing optional arguments to BatchDecodeWithPagedKVCacheWrapper."
                          "plan() positionally is deprecated", DeprecationWarning, stacklevel=2)
        return self._plan_impl(indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                               head_dim, page_size, **kwargs)

    def _plan_impl(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                   page_size, *, pos_encoding_mode="NONE", window_left=-1, window_right=0,
                   logits_soft_cap=None, q_data_type="float16", kv_data_type=None,
                   o_data_type=None, data_type=None, sm_scale=None, rope_scale=None,
                   rope_theta=None, non_blocking=True, block_tables=None, seq_lens=None,
                   fixed_split_size=None, disable_split_kv=False, q_len_per_req=1,
                   is_causal=None):
        # Ignored (hints, or RoPE parameters with no RoPE): rope_scale, rope_theta,
        # non_blocking, disable_split_kv, fixed_split_size (checked as 0.7.2 does).
        core.check_geometry(num_qo_heads, num_kv_heads, head_dim, page_size)
        core.check_pos_encoding(pos_encoding_mode)
        core.refuse(window_left=(window_left, -1), block_tables=(block_tables, None),
                    seq_lens=(seq_lens, None))
        if window_right != 0:
            raise NotImplementedError("BatchDecodeWithPagedKVCacheWrapper only supports "
                                      "window_right != 0 with backend='cute-dsl'")
        if logits_soft_cap not in (None, 0, 0.0):
            core.refuse(logits_soft_cap=(logits_soft_cap, None))
        if data_type is not None:
            q_data_type = data_type if q_data_type is None else q_data_type
            kv_data_type = data_type if kv_data_type is None else kv_data_type
        q_dtype, kv_dtype, o_dtype = core.plan_dtypes(q_data_type, kv_data_type, o_data_type)
        sm_scale = core.check_scalar("sm_scale", sm_scale)
        if isinstance(q_len_per_req, bool) or not isinstance(q_len_per_req, int):
            raise TypeError(f"q_len_per_req must be an int, got {q_len_per_req!r}")
        if q_len_per_req < 1:
            raise ValueError(f"q_len_per_req must be >= 1, got {q_len_per_req}")
        if is_causal is None:
            is_causal = q_len_per_req > 1
        elif is_causal != (q_len_per_req > 1):
            raise NotImplementedError("the decode mask derives from q_len_per_req; an "
                                      "explicit is_causal override is not supported")
        if q_len_per_req > 1 and not self._use_tensor_cores:
            raise ValueError("q_len_per_req > 1 requires tensor-core decode (use_tensor_cores="
                             "True or the trtllm-gen/cute-dsl/cudnn backend).")
        if q_len_per_req > 1 and self._backend == "fa3":
            raise NotImplementedError("q_len_per_req > 1 is currently only supported on the "
                                      "fa2 tensor-core backend.")
        if fixed_split_size is not None and not self._use_tensor_cores:
            raise ValueError("fixed_split_size is only supported by tensor core decode for now.")
        indptr = core.int32_vector("indptr", indptr)
        indices = core.int32_vector("indices", indices)
        last = core.int32_vector("last_page_len", last_page_len)
        batch_size = len(last)
        if self._use_cuda_graph:
            if self._q_len_per_req is not None and self._q_len_per_req != q_len_per_req:
                raise ValueError("q_len_per_req is part of the frozen cudagraph shape: this "
                                 f"wrapper was planned with {self._q_len_per_req}, got "
                                 f"{q_len_per_req}. Use a separate wrapper per q_len_per_req.")
            if batch_size != self._fixed_batch_size:
                raise ValueError(
                    f"The batch size should be fixed in cudagraph mode, the runtime batch size "
                    f"{batch_size}  mismatches the batch size set during initialization "
                    f"{self._fixed_batch_size}")
            if len(indices) > len(self._paged_kv_indices_buf):
                raise ValueError("The size of indices should be less than or equal to the "
                                 "allocated buffer")
            ptr, lens = core.check_metadata(indptr, len(self._paged_kv_indices_buf), last,
                                            page_size, exact=False)
        else:
            ptr, lens = core.check_metadata(indptr, len(indices), last, page_size, exact=True)
        group = num_qo_heads // num_kv_heads
        if not self._use_tensor_cores and group not in core.CUDA_CORE_GROUP_SIZES:
            raise RuntimeError(f"Unsupported group_size: {group}")
        kv_lens = [(ptr[i + 1] - ptr[i] - 1) * page_size + lens[i] for i in range(batch_size)]
        if is_causal and kv_lens and min(kv_lens) < q_len_per_req:
            raise ValueError(f"q_len_per_req={q_len_per_req} requires kv_len >= q_len_per_req "
                             f"for every request, but got a request with kv_len={min(kv_lens)}")
        self._store(None, indptr, indices, last, page_size)
        self._q_len_per_req = q_len_per_req
        # Under CUDA graphs with split-KV (one query a request) the plan fixes each request's
        # KV tiles from the planned lengths: a longer sequence at run time would lose keys.
        self._planned_kv_lens = (kv_lens if self._use_cuda_graph and q_len_per_req == 1
                                 and not disable_split_kv else None)
        self._plan = dict(q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype,
                          num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, page_size=page_size, causal=is_causal,
                          sm_scale=sm_scale, batch_size=batch_size, device=self.device)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse=False, enable_pdl=None, window_left=None, sinks=None,
            q_len_per_req=None, skip_softmax_threshold_scale_factor=None, kv_cache_sf=None):
        plan = self._require_plan()
        self._check_run_options(
            args, lse, return_lse, window_left, sinks=sinks, kv_cache_sf=kv_cache_sf,
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor)
        k_cache, v_cache = core.unpack_cache(paged_kv_cache, plan)
        planned = self._q_len_per_req
        if q_len_per_req is not None:
            warnings.warn("Passing `q_len_per_req` to BatchDecodeWithPagedKVCacheWrapper.run() "
                          "is deprecated; pass it to plan() instead.", DeprecationWarning,
                          stacklevel=2)
            if q_len_per_req != planned:
                raise ValueError(f"q_len_per_req={q_len_per_req} but plan() used {planned}")
        core.check_q(q, plan, plan["batch_size"] * planned)
        core.check_out(out, q, plan["o_dtype"])
        indptr, indices, last = self._metadata(k_cache.shape[0])
        if self._planned_kv_lens is not None:
            for i, planned_len in enumerate(self._planned_kv_lens):
                kv_len = (indptr[i + 1] - indptr[i] - 1) * plan["page_size"] + last[i]
                if kv_len > planned_len:
                    raise RuntimeError(f"request {i} holds {kv_len} keys; the split-KV plan "
                                       f"covers {planned_len} (plan() again for them)")
        qo = [i * planned for i in range(plan["batch_size"] + 1)]
        scale = core.softmax_scale(plan, q_scale, k_scale)
        o = core.attention(q, k_cache, v_cache, qo, indptr, indices, last, plan["causal"], scale)
        return core.finish(o, v_scale, plan["o_dtype"], out)


class BatchPrefillWithRaggedKVCacheWrapper:
    """Prefill over contiguous (ragged) K/V: segment i's rows qo_indptr[i]:qo_indptr[i+1]
    read keys kv_indptr[i]:kv_indptr[i+1] of the k / v given to run().  Eager only."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None,
                 mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None,
                 variant_owns_mask=False):
        core.check_workspace(float_workspace_buffer)
        core.check_layout(kv_layout)
        core.check_backend(backend, _PREFILL_BACKENDS)
        core.refuse(use_cuda_graph=(core.check_bool("use_cuda_graph", use_cuda_graph), False),
                    qo_indptr_buf=(qo_indptr_buf, None), kv_indptr_buf=(kv_indptr_buf, None),
                    custom_mask_buf=(custom_mask_buf, None),
                    mask_indptr_buf=(mask_indptr_buf, None), jit_args=(jit_args, None),
                    jit_kwargs=(jit_kwargs, None), variant_owns_mask=(variant_owns_mask, False))
        self.device = float_workspace_buffer.device
        self._plan = None

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk,
             head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, window_left=-1,
             logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking=True,
             prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0,
             max_item_len_ptr=None, fixed_split_size=None, disable_split_kv=False,
             seq_lens=None, seq_lens_q=None, max_token_per_sequence=None,
             max_sequence_kv=None, v_indptr=None, o_indptr=None, uniform_q_len=None):
        # Ignored (hints): non_blocking, rope_scale, rope_theta, fixed_split_size,
        # disable_split_kv, max_token_per_sequence, max_sequence_kv, uniform_q_len.
        core.check_prefill_plan(locals(), 1, "v_indptr", "o_indptr")  # no pages
        q_dtype, kv_dtype, o_dtype = core.plan_dtypes(q_data_type, kv_data_type, o_data_type)
        qo = core.check_qo_indptr(core.int32_vector("qo_indptr", qo_indptr))
        kv = core.check_qo_indptr(core.int32_vector("kv_indptr", kv_indptr), "kv_indptr")
        if len(kv) != len(qo):
            raise ValueError(f"kv_indptr has {len(kv)} entries, qo_indptr {len(qo)}: both "
                             "must be batch_size + 1")
        self._plan = dict(q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype,
                          num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim_qk, causal=causal,
                          sm_scale=core.check_scalar("sm_scale", sm_scale), qo=qo, kv=kv,
                          device=self.device)

    def run(self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, o_scale=None,
            out=None, lse=None, return_lse=False, lse_base="log2", lse_layout="NH",
            enable_pdl=None, kv_cache_sf=None):
        plan = self._plan
        if plan is None:
            raise RuntimeError("plan() must be called before run()")
        core.PagedWrapper._check_run_options(args, lse, return_lse, None, lse_ok=True,
                                             o_scale=o_scale, kv_cache_sf=kv_cache_sf)
        if return_lse:
            core.refuse(lse_base=(lse_base, "log2"), lse_layout=(lse_layout, "NH"))
        qo, kv = plan["qo"], plan["kv"]
        core.check_q(q, plan, qo[-1])
        for name, t in (("k", k), ("v", v)):
            want = (kv[-1], plan["num_kv_heads"], plan["head_dim"])
            if not torch.is_tensor(t) or tuple(t.shape) != want or t.dtype != plan["kv_dtype"]:
                raise ValueError(f"{name} must be {plan['kv_dtype']} of shape {want}")
            if t.stride(-1) != 1:  # the kernels take token and head strides, not this one
                raise ValueError(f"{name}'s head_dim must be contiguous, strides {t.stride()}")
        core.check_out(out, q, plan["o_dtype"])
        scale = core.softmax_scale(plan, q_scale, k_scale)
        o, row_lse = core.segments(q, lambda i: (k[kv[i]:kv[i + 1]], v[kv[i]:kv[i + 1]]), qo,
                                   len(qo) - 1, plan["causal"], scale, True)
        result = core.finish(o, v_scale, plan["o_dtype"], out)
        return (result, row_lse) if return_lse else result
