"""Checks, attention math and the base class of the FlashInfer 0.7.2.post1 stand-in wrappers.

See ``flashinfer_standin`` for what the stand-in is.  Every check raises the way
FlashInfer does where FlashInfer checks (same exception type, similar message) and
ValueError / TypeError where only the CUDA kernel would have failed (or silently
read out of bounds).  Options the stand-in cannot compute raise NotImplementedError
naming the option, and only when a non-default value is passed.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

# DISPATCH_GQA_GROUP_SIZE (include/flashinfer/utils.cuh of the 0.7.2.post1 wheel): the
# group sizes the CUDA-core batch decode kernel is compiled for; BatchDecodeWithPaged
# KVCachePlan raises "Unsupported group_size: N" for any other.
CUDA_CORE_GROUP_SIZES = (1, 2, 3, 4, 6, 8, 16)
POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")
KV_LAYOUTS = ("NHD", "HND")


def refuse(**options) -> None:
    """``name=(value, default)``: NotImplementedError for the first non-default value."""
    for name, (value, default) in options.items():
        same = value is default or (not torch.is_tensor(value) and not torch.is_tensor(default)
                                    and type(value) is type(default) and value == default)
        if not same:
            raise NotImplementedError(
                f"flashinfer stand-in: {name}={_show(value)} is not supported (only the "
                f"default {default!r})")


def _show(value) -> str:
    if torch.is_tensor(value):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    return repr(value)


def check_workspace(buffer) -> None:
    if not torch.is_tensor(buffer):
        raise TypeError(f"float_workspace_buffer must be a torch.Tensor, got {type(buffer)}")
    if buffer.numel() and buffer.data_ptr() % 16:
        raise ValueError("float_workspace_buffer must be 16-byte aligned, got data_ptr % 16 = "
                         f"{buffer.data_ptr() % 16}")


def check_layout(kv_layout) -> None:
    if kv_layout not in KV_LAYOUTS:
        raise KeyError(f"Invalid kv_layout {kv_layout}")
    refuse(kv_layout=(kv_layout, "NHD"))


def check_pos_encoding(mode) -> None:
    if mode not in POS_ENCODING_MODES:
        raise KeyError(f"Invalid pos_encoding_mode {mode}")
    refuse(pos_encoding_mode=(mode, "NONE"))


def check_backend(backend, allowed) -> None:
    if backend not in allowed:
        raise NotImplementedError(f"flashinfer stand-in: backend={backend!r} is not supported "
                                  f"(one of {allowed})")


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def canonical_dtype(dtype, name: str) -> torch.dtype:
    """canonicalize_torch_dtype of flashinfer/utils.py: a torch.dtype or its name."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a string or torch.dtype, got {dtype!r}")
    return dtype


def plan_dtypes(q_data_type, kv_data_type, o_data_type):
    """(q, kv, o) dtypes of a plan: kv and o default to q's, as in FlashInfer."""
    q = canonical_dtype(q_data_type, "q_data_type")
    kv = q if kv_data_type is None else canonical_dtype(kv_data_type, "kv_data_type")
    o = q if o_data_type is None else canonical_dtype(o_data_type, "o_data_type")
    return q, kv, o


def check_geometry(num_qo_heads, num_kv_heads, head_dim, page_size) -> None:
    for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("page_size", page_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads {num_qo_heads} must be a multiple of num_kv_heads "
                         f"{num_kv_heads}")


def check_scalar(name: str, value, *, allow_tensor: bool = False):
    if value is None:
        return None
    if torch.is_tensor(value):
        raise NotImplementedError(f"flashinfer stand-in: tensor {name} is not supported")
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    return float(value)


def int32_vector(name: str, tensor) -> torch.Tensor:
    if not torch.is_tensor(tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {tensor.dtype}")
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    return tensor


#: plan() options both prefill wrappers refuse unless left at these defaults
PREFILL_REFUSED = {"custom_mask": None, "packed_custom_mask": None,
                   "use_fp16_qk_reduction": False, "window_left": -1, "prefix_len_ptr": None,
                   "token_pos_in_items_ptr": None, "token_pos_in_items_len": 0,
                   "max_item_len_ptr": None, "seq_lens": None, "seq_lens_q": None}


def check_prefill_plan(args: dict, page_size: int, *also_refused: str) -> None:
    """What the paged and ragged prefill wrappers' plan() check alike, from the call's
    arguments ``args`` (its ``locals()``): the geometry, the options the stand-in does not
    model (:data:`PREFILL_REFUSED` and ``also_refused``, which default to None)."""
    check_geometry(args["num_qo_heads"], args["num_kv_heads"], args["head_dim_qk"], page_size)
    if args["head_dim_vo"] is not None and args["head_dim_vo"] != args["head_dim_qk"]:
        refuse(head_dim_vo=(args["head_dim_vo"], None))
    check_pos_encoding(args["pos_encoding_mode"])
    defaults = {**PREFILL_REFUSED, **dict.fromkeys(also_refused)}
    refuse(**{name: (args[name], default) for name, default in defaults.items()})
    if args["logits_soft_cap"] not in (None, 0, 0.0):
        refuse(logits_soft_cap=(args["logits_soft_cap"], None))
    check_bool("causal", args["causal"])


def check_qo_indptr(qo: torch.Tensor, name: str = "qo_indptr") -> list[int]:
    values = qo.tolist()
    if not values or values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[:1]}")
    bad = [i for i in range(len(values) - 1) if values[i + 1] < values[i]]
    if bad:
        raise ValueError(f"{name} decreases at request {bad[0]}: {values[bad[0]]} -> "
                         f"{values[bad[0] + 1]}")
    return values


def check_metadata(indptr: torch.Tensor, num_indices: int, last: torch.Tensor, page_size: int,
                   *, exact: bool) -> tuple[list[int], list[int]]:
    """paged_kv_indptr [B+1], paged_kv_last_page_len [B] against ``num_indices`` entries.

    ``exact``: indptr[-1] must equal num_indices (a plan's own indices), else fit in them
    (a CUDA-graph buffer longer than the pages used).
    """
    if indptr.shape[0] != last.shape[0] + 1:
        raise ValueError(f"paged_kv_indptr has {indptr.shape[0]} entries, expected "
                         f"len(paged_kv_last_page_len) + 1 = {last.shape[0] + 1}")
    ptr = check_qo_indptr(indptr, "paged_kv_indptr")
    empty = [i for i in range(len(ptr) - 1) if ptr[i + 1] == ptr[i]]
    if empty:
        raise ValueError(f"request {empty[0]} has no KV page (paged_kv_indptr[{empty[0]}] == "
                         f"paged_kv_indptr[{empty[0] + 1}]): every request needs >= 1 page")
    if (ptr[-1] != num_indices) if exact else (ptr[-1] > num_indices):
        relation = "equal" if exact else "be at most"
        raise ValueError(f"paged_kv_indptr[-1] = {ptr[-1]} must {relation} the number of page "
                         f"indices {num_indices}")
    lens = last.tolist()
    bad = [i for i, n in enumerate(lens) if not 1 <= n <= page_size]
    if bad:
        raise ValueError(f"paged_kv_last_page_len[{bad[0]}] = {lens[bad[0]]} is outside "
                         f"[1, page_size={page_size}]")
    return ptr, lens


def check_pages(indices: torch.Tensor, used: int, num_pages: int) -> None:
    pages = indices[:used]
    bad = ((pages < 0) | (pages >= num_pages)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"paged_kv_indices[{i}] = {int(pages[i])} is not a page of the cache "
                         f"(0..{num_pages - 1})")


def unpack_cache(paged_kv_cache, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) NHD caches [num_pages, page_size, num_kv_heads, head_dim] of the planned dtype."""
    if torch.is_tensor(paged_kv_cache):
        raise NotImplementedError("flashinfer stand-in: a single 5-D paged_kv_cache tensor is "
                                  "not supported, pass a tuple (k_cache, v_cache)")
    if not isinstance(paged_kv_cache, tuple):
        raise TypeError(f"Unrecognized paged_kv_cache type {type(paged_kv_cache)}, expect a "
                        "single tensor or a tuple of tensor.")
    if len(paged_kv_cache) != 2 or not all(torch.is_tensor(t) for t in paged_kv_cache):
        raise TypeError("paged_kv_cache must be a tuple of two tensors (k_cache, v_cache)")
    k, v = paged_kv_cache
    expected = (plan["page_size"], plan["num_kv_heads"], plan["head_dim"])
    for name, t in (("k_cache", k), ("v_cache", v)):
        if t.dim() != 4 or tuple(t.shape[1:]) != expected:
            raise ValueError(f"{name} must be [num_pages, page_size, num_kv_heads, head_dim] = "
                             f"[*, {expected[0]}, {expected[1]}, {expected[2]}] (NHD), got "
                             f"{tuple(t.shape)}")
        if t.dtype != plan["kv_dtype"]:
            raise ValueError(f"The dtype of {name[0]} {t.dtype} does not match the kv_data_type "
                             f"{plan['kv_dtype']} specified in plan function.")
        if t.device != plan["device"]:
            raise ValueError(f"{name} is on {t.device}, the wrapper on {plan['device']}")
    if v.shape != k.shape:
        raise ValueError(f"v_cache shape {tuple(v.shape)} differs from k_cache {tuple(k.shape)}")
    return k, v


def check_q(q, plan, rows: int) -> None:
    if not torch.is_tensor(q):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype != plan["q_dtype"]:
        raise ValueError(f"The dtype of q {q.dtype} does not match the q_data_type "
                         f"{plan['q_dtype']} specified in plan function.")
    expected = (rows, plan["num_qo_heads"], plan["head_dim"])
    if q.dim() != 3 or tuple(q.shape) != expected:
        raise ValueError(f"q must have shape {list(expected)} ([rows, num_qo_heads, head_dim] "
                         f"of the plan), got {list(q.shape)}")
    if q.device != plan["device"]:
        raise ValueError(f"q is on {q.device}, the wrapper on {plan['device']}")


def check_out(out, q, dtype) -> None:
    if out is None:
        return
    if not torch.is_tensor(out):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != q.shape:
        raise ValueError(f"Invalid shape of out: expected {tuple(q.shape)}, got "
                         f"{tuple(out.shape)}")
    if out.dtype != dtype:
        raise ValueError(f"Invalid dtype of out: expected {dtype}, got {out.dtype}")
    if out.device != q.device:
        raise ValueError(f"Invalid device of out: expected {q.device}, got {out.device}")


def softmax_scale(plan, q_scale, k_scale) -> float:
    """run() of 0.7.2: sm_scale (plan; default 1/sqrt(head_dim)) * q_scale * k_scale."""
    scale = plan["sm_scale"]
    scale = 1.0 / math.sqrt(plan["head_dim"]) if scale is None else scale
    for name, factor in (("q_scale", q_scale), ("k_scale", k_scale)):
        factor = check_scalar(name, factor)
        if factor is not None:
            scale *= factor
    return scale


def attention(q, k_cache, v_cache, qo, kv_indptr, indices, last, causal: bool,
              scale: float, with_lse: bool = False):
    """Exact paged attention in float32; rows no request covers (or that see no key) are 0.

    Request i: query rows qo[i]:qo[i+1]; keys from pages indices[kv_indptr[i]:kv_indptr[i+1]],
    kv_len = (pages - 1) * page_size + last[i].  Causal masks are bottom-right aligned:
    row j of q_len sees keys [0, kv_len - q_len + j].  Query head h reads KV head h // group.
    ``with_lse``: also the rows' base-2 log-sum-exp of the scaled scores [rows, Hq] (-inf
    where a row sees no key), as run(return_lse=True) gives it.
    """
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]

    def keys(i):
        pages = indices[kv_indptr[i]:kv_indptr[i + 1]].long()
        kv_len = (pages.shape[0] - 1) * page_size + last[i]
        return (k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len],
                v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len])

    return segments(q, keys, qo, len(last), causal, scale, with_lse)


def segments(q, keys, qo, count: int, causal: bool, scale: float, with_lse: bool):
    """Attention of ``count`` segments: rows qo[i]:qo[i+1] over ``keys(i)`` = (k, v)
    [kv_len, Hkv, D] (see :func:`attention`)."""
    head_dim = q.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(count):
        q_len = qo[i + 1] - qo[i]
        if q_len == 0:
            continue
        k, v = (t.float() for t in keys(i))
        kv_len, num_kv_heads = k.shape[0], k.shape[1]
        group = q.shape[1] // num_kv_heads
        qi = q[qo[i]:qo[i + 1]].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", qi, k) * scale
        if causal:
            limit = kv_len - q_len + torch.arange(q_len, device=q.device)
            allowed = torch.arange(kv_len, device=q.device)[None, :] <= limit[:, None]
            scores = scores.masked_fill(~allowed, float("-inf"))
        weights = scores.softmax(dim=-1).nan_to_num(nan=0.0)  # a row seeing no key -> 0
        o = torch.einsum("hgqk,khd->qhgd", weights, v)
        out[qo[i]:qo[i + 1]] = o.reshape(q_len, num_kv_heads * group, head_dim)
        row_lse = torch.logsumexp(scores, dim=-1) / math.log(2)  # [h, g, q]
        lse[qo[i]:qo[i + 1]] = row_lse.permute(2, 0, 1).reshape(q_len, num_kv_heads * group)
    return (out, lse) if with_lse else out


def merge_state(v_a, s_a, v_b, s_b):
    """flashinfer.merge_state (0.7.2): two partial states (outputs [rows, H, D], base-2
    LSE [rows, H] float32) of disjoint key sets -> the state over both."""
    for name, s in (("s_a", s_a), ("s_b", s_b)):
        if s.dtype != torch.float32 or s.shape != v_a.shape[:2]:
            raise ValueError(f"{name} must be float32 of shape {tuple(v_a.shape[:2])}")
    if v_b.shape != v_a.shape or v_b.dtype != v_a.dtype:
        raise ValueError("v_a and v_b must have the same shape and dtype")
    top = torch.maximum(s_a, s_b)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w_a, w_b = torch.exp2(s_a - top), torch.exp2(s_b - top)
    total = w_a + w_b
    v = v_a.float() * (w_a / total)[..., None] + v_b.float() * (w_b / total)[..., None]
    return v.nan_to_num(nan=0.0).to(v_a.dtype), torch.log2(total) + top


def finish(o: torch.Tensor, v_scale, dtype: torch.dtype, out):
    """run()'s epilogue as in 0.7.2: the kernel writes o in the output dtype, then
    ``out *= v_scale`` (skipped for exactly 1.0; the output is scaled, not V)."""
    v_scale = check_scalar("v_scale", v_scale)
    result = o.to(dtype)
    if v_scale is not None and v_scale != 1.0:
        result = result * v_scale
    return result if out is None else out.copy_(result)


class PagedWrapper:
    """What both wrappers share: graph buffers, plan state, the metadata read by run()."""

    _plan = None

    def _graph_buffers(self, use_cuda_graph, buffers: dict) -> None:
        self._use_cuda_graph = check_bool("use_cuda_graph", use_cuda_graph)
        if use_cuda_graph:
            for name, buf in buffers.items():
                if not torch.is_tensor(buf):
                    raise ValueError(f"{name} should be a torch.Tensor in cudagraph mode")
                int32_vector(name, buf)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def _store(self, qo, indptr, indices, last, page_size) -> None:
        """Graph mode: copy into the caller's buffers (checked to fit); else keep copies."""
        if self._use_cuda_graph:
            if qo is not None:
                self._qo_indptr_buf.copy_(qo)
            self._paged_kv_indptr_buf.copy_(indptr)
            self._paged_kv_last_page_len_buf.copy_(last)
            self._paged_kv_indices_buf[: len(indices)].copy_(indices)
        else:
            self._qo = None if qo is None else qo.tolist()
            self._meta = (indptr.tolist(), indices.to(self.device, torch.int64).clone(),
                          last.tolist())

    def _metadata(self, num_pages: int):
        """(kv_indptr, indices, last_page_len) for run(): the buffers as they are now."""
        if self._use_cuda_graph:
            indices = self._paged_kv_indices_buf
            indptr, last = check_metadata(
                self._paged_kv_indptr_buf, len(indices), self._paged_kv_last_page_len_buf,
                self._plan["page_size"], exact=False)
            indices = indices.long()
        else:
            indptr, indices, last = self._meta
        check_pages(indices, indptr[-1], num_pages)
        return indptr, indices, last

    def _require_plan(self) -> dict:
        if self._plan is None:
            raise RuntimeError("plan() must be called before run()")
        return self._plan

    @staticmethod
    def _check_run_options(args, lse, return_lse, window_left, lse_ok=False,
                           **options) -> None:
        if args:
            raise NotImplementedError("flashinfer stand-in: positional *args of run() (custom "
                                      "kernel arguments / FP8 scale tensors) are not supported")
        refuse(lse=(lse, None), **{name: (value, None) for name, value in options.items()})
        if not lse_ok:  # the prefill wrappers return it; the stand-in's decode does not
            refuse(return_lse=(check_bool("return_lse", return_lse), False))
        if window_left is not None and window_left != -1:
            raise NotImplementedError(f"flashinfer stand-in: window_left={window_left!r} is "
                                      "not supported (sliding window)")
