"""Llama-4 mixture of experts: each token's top-k experts only, loop-free and capturable.

Routing is transformers' ``Llama4Router`` (models/routing.py): logits ``x @ router.T``,
top-k per token, score ``sigmoid(top logit)`` (float32, cast to the activation dtype), and
the score scales the expert's *input* (``expert(score * x)``), not its output.  The shared
expert runs on every token and is added to the routed experts' sum.

One step, whatever its size: the ``tokens * top_k`` (token, expert) pairs are sorted by
expert on the device (``torch.sort`` + ``searchsorted`` give int32 cumulative offsets),
gathered, run through two grouped GEMMs (``torch._grouped_mm``; each expert's weights
are read once and only routed rows are multiplied) and scattered back.  No shape
depends on the routing and nothing waits for the host, so steps can be captured in
CUDA graphs.

Weights, ``(N, K)`` per expert as ``nn.Linear`` holds them (so per-output-channel FP8
scales are ``[E, N]``): ``w13 [E, 2 * inner, hidden]`` (gate rows, then up rows) and
``w2 [E, hidden, inner]``.  :func:`hf_expert_tensor` maps transformers' checkpoint
layout (``gate_up_proj [E, hidden, 2 * inner]``, ``down_proj [E, inner, hidden]``).
After :meth:`MoE.stack_shared` the shared expert is slot ``E`` of the same stacks, so
steps of at most ``fuse_max_tokens`` run it as one more group in the same two GEMMs
(every token routed to it with score 1) and longer steps as dense GEMMs on the slot.
Steps of at most ``triton_max_pairs`` pairs run the routed GEMMs through
``moe_triton``'s kernel instead (decode sizes; off by default).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

import chunklocal.models.routing as routing
from chunklocal.models.fused import GatedMLPBase, gated_act, is_silu
from chunklocal.models.parallel import SINGLE, ShardRule, TPGroup, column_parallel, row_parallel
from chunklocal.models.quant import Fp8Linear, fp8_linear
from chunklocal.models.quant_triton import (
    QuantRows,
    quant_available,
    quantize_rows,
    silu_mul_quantize,
)

FP8_DTYPES = (torch.float8_e4m3fn,)

# How loaded models run their MoE layers (see :func:`configure`), chosen from
# benchmarks/moe.py on the H200 (BENCHMARKS.md, "MoE layer"): stacking or fusing the shared
# expert measured no faster in bf16 (torch._grouped_mm), so for float weights both stay off;
# the Triton kernel beats torch._grouped_mm while experts average at most 16 rows each (it
# reads each touched expert once per N-tile without padding rows up to the grouped GEMM's
# tile), and loses beyond.
STACK_SHARED = False    # float weights: the shared expert into slot E of the stacks
FUSE_MAX_TOKENS = 0     # float weights: steps up to this many tokens run it as group E
#: FP8 layers: the shared expert stacked into slot E and run as one more group of the routed
#: experts' GEMMs on steps of at most this many tokens (0: never;
#: ``CHUNKLOCAL_MOE_SHARED_GROUP_TOKENS``), as dense FP8 GEMMs on the slot beyond.  Apart, a
#: decode step's shared expert is four GEMM launches (each with its split-K sum and cast), a
#: quantization, an activation and an add: about ten kernels a layer, each a few microseconds
#: at batch 1 (BENCHMARKS.md, fifteenth session).  As group E its rows share the routed
#: rows' quantization (score 1) and the two split-K launches.  16: the split-K kernel's row
#: tile (``moe_triton.FP8_BLOCK_M``), past which it re-reads the weights.  On since the
#: seventeenth session (``benchmarks/switch_ab.py --model scout-fp8-12 --switches shared``,
#: an H100: 12 of Scout FP8's layers, 5.7% less per step at batch 1 and 2.1% at 16, outside
#: the rounds' spread; tests/gpu/test_fp8_gpu.py holds the tokens to the fake-quant oracle).
SHARED_GROUP_TOKENS = int(os.environ.get("CHUNKLOCAL_MOE_SHARED_GROUP_TOKENS", "16"))
TRITON_PAIRS_PER_EXPERT = 16  # steps up to this many (token, expert) pairs per expert
#: Longer steps run the block in slices of this many tokens (each token's output is its own),
#: so the memory profile's peak (reserved for good, engine/memory.py) holds one slice's
#: intermediates.  Full-size Scout FP8 on the H200 (BENCHMARKS.md): slices of 4096 in an
#: 8192-token step cut the peak 3.35 -> 2.98 GiB (296 sequences fit, not 292) but made the
#: 8k / 32k prefill 3-5% slower (2048: 13-18%), so only steps past vLLM's 8192-token
#: serving default are sliced, at no cost.  0: never.  ``CHUNKLOCAL_MOE_CHUNK_TOKENS``.
MOE_CHUNK_TOKENS = int(os.environ.get("CHUNKLOCAL_MOE_CHUNK_TOKENS", "8192"))
#: FP8 experts: one kernel gathers the routed tokens, scales them by their scores and
#: quantizes them for the first expert GEMM (``quant_triton.quantize_rows`` with ``rows``),
#: where torch gathered, multiplied and then the quantizer read the product: at a full-size
#: Scout FP8 8k prefill step the gather and the product took about 7.5 ms of 415, and a
#: decode step launches two kernels a layer for them (BENCHMARKS.md, fourteenth session).
#: The same bits either way.  On since the fifteenth session's H200 run (with SILU_QUANT and
#: the 16-bit KV write: the 8k / 32k prefill 2% faster, BENCHMARKS.md); off with
#: ``CHUNKLOCAL_MOE_GATHER_QUANT=0`` (tests/gpu/test_fp8_quant_gpu.py, test_fp8_gpu.py).
GATHER_QUANT = os.environ.get("CHUNKLOCAL_MOE_GATHER_QUANT", "1") == "1"
#: The same for the second expert GEMM's rows: ``silu(gate) * up`` and its per-token
#: quantization in one kernel (``quant_triton.silu_mul_quantize``), where ``silu_and_mul``
#: stored the bf16 product and the quantizer read it twice (issue 19: quantization fused
#: into the kernel that produces the activation).  Rounded to bf16 before quantizing, as
#: ``silu_and_mul`` rounds it; the SiLU's exp is Triton's, so a product may differ from
#: FlashInfer's by a bf16 ulp.  On since the fifteenth session's H200 run (as GATHER_QUANT);
#: off with ``CHUNKLOCAL_MOE_SILU_QUANT=0`` (tests/gpu/test_fp8_quant_gpu.py, test_fp8_gpu.py).
SILU_QUANT = os.environ.get("CHUNKLOCAL_MOE_SILU_QUANT", "1") == "1"
#: SILU_QUANT for the stacked shared expert's dense GEMMs too (prefill steps, past
#: ``fuse_max_tokens``), where FlashInfer's ``silu_and_mul`` stored the bf16 product and the
#: quantizer read it back: a 12-layer 8k prefill step of Scout FP8 on an H100 spent 1.5 ms
#: in ``silu_and_mul`` alone (29th session).  ``CHUNKLOCAL_MOE_SHARED_SILU_QUANT=1``,
#: ``--switches shared_silu``; off until a GPU run.
SHARED_SILU_QUANT = os.environ.get("CHUNKLOCAL_MOE_SHARED_SILU_QUANT", "0") == "1"

def gather_quant_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The MoE layer's first expert GEMM takes its rows gathered, scaled and quantized by
    one kernel (:data:`GATHER_QUANT`): FP8 weights, and quant_triton's kernel runs on ``x``."""
    return GATHER_QUANT and w.dtype in FP8_DTYPES and quant_available(x)


def silu_quant_available(gate_up: torch.Tensor, w: torch.Tensor, act: nn.Module,
                         amax_reduce) -> bool:
    """The second expert GEMM takes ``act(gate) * up`` made and quantized by one kernel
    (:data:`SILU_QUANT`): FP8 weights, a SiLU, no cross-rank amax, and quant_triton's kernel
    runs on ``gate_up``."""
    return (SILU_QUANT and w.dtype in FP8_DTYPES and is_silu(act) and amax_reduce is None
            and quant_available(gate_up) and gate_up.is_contiguous())


def activation_rows(gate_up: torch.Tensor, w: torch.Tensor, act: nn.Module, scale_ub,
                    amax_reduce, fuse: bool = True) -> torch.Tensor | QuantRows:
    """``act(gate) * up`` of ``gate_up``, the input of the GEMM with ``w``: made and
    quantized by one kernel (``QuantRows``) where ``fuse`` and :func:`silu_quant_available`,
    else :func:`gated_act`'s product."""
    if fuse and silu_quant_available(gate_up, w, act, amax_reduce):
        return QuantRows(*silu_mul_quantize(gate_up, scale_ub), gate_up.dtype)
    return gated_act(gate_up, act)


def expert_mm(x: torch.Tensor | QuantRows, w: torch.Tensor, offs: torch.Tensor,
              w_scale: torch.Tensor | None = None, small_m: bool = False,
              act_scale_ub: float | None = None, amax_reduce=None,
              group_rows: int | None = None) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of ``x [M, K]`` times ``w[e].T`` (``w [E, N, K]``) -> [M, N].

    float8 weights with per-output-channel ``w_scale [E, N]`` go to
    ``quant.fp8_grouped_mm`` (with ``small_m``, and no cross-rank amax, to
    ``moe_triton.fp8_grouped_mm_small``); float weights to ``torch._grouped_mm`` where torch has a
    grouped kernel for the device and dtype (CUDA bf16 on sm90/sm100; the CPU's float32,
    bf16 and float16).  Otherwise, eagerly, torch's own per-group fallback (it reads
    ``offs`` on the host), and under CUDA-graph capture or where torch has none (float64)
    :func:`padded_mm`.  ``small_m`` (few rows per expert, float weights, where
    ``moe_triton.available``): the Triton kernel of ``moe_triton`` instead.
    """
    if w.dtype in FP8_DTYPES:
        if w_scale is None:
            raise ValueError(f"float8 expert weights {tuple(w.shape)} need a weight scale")
        from chunklocal.models.quant import fp8_grouped_mm

        if small_m and amax_reduce is None:
            import chunklocal.models.moe_triton as moe_triton

            if moe_triton.fp8_available(x):
                return moe_triton.fp8_grouped_mm_small(x, w, w_scale, offs, act_scale_ub,
                                                       group_rows=group_rows)
        # act_scale_ub: fbgemm_fp8's cap on a token's activation amax (models/quant.py);
        # amax_reduce: tensor parallel, rows hold one rank's slice of the inner size
        if act_scale_ub is None and amax_reduce is None:
            return fp8_grouped_mm(x, w, w_scale, offs)
        return fp8_grouped_mm(x, w, w_scale, offs, act_scale_ub=act_scale_ub,
                              amax_reduce=amax_reduce)
    if w_scale is not None:
        raise ValueError(f"a weight scale was given for {w.dtype} expert weights")
    if isinstance(x, QuantRows):
        raise ValueError(f"quantized rows for {w.dtype} expert weights (FP8 weights only)")
    if small_m:
        import chunklocal.models.moe_triton as moe_triton

        if moe_triton.available(x):
            return moe_triton.grouped_mm_small(x, w, offs)
    if _native_grouped_mm(x.device, x.dtype) or (
            not _capturing(x) and _torch_grouped_mm_runs(x.device.type, x.dtype)):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    return padded_mm(x, w, offs)


def padded_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """:func:`expert_mm` through one bmm in which every expert sees all ``M`` rows, zero
    outside its own: exact in any dtype and capturable, at E times the routed FLOPs."""
    rows = torch.arange(x.shape[0], device=x.device)
    group = torch.searchsorted(offs, rows.to(offs.dtype), right=True).clamp_(max=w.shape[0] - 1)
    padded = x.new_zeros(w.shape[0], x.shape[0], x.shape[1])
    padded[group, rows] = x
    return torch.bmm(padded, w.transpose(1, 2))[group, rows]


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


@functools.cache
def _native_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Torch runs ``_grouped_mm`` as one kernel here (no per-group host loop)."""
    if device.type == "cuda":
        major = torch.cuda.get_device_capability(device)[0]
        return dtype == torch.bfloat16 and major in (9, 10) and hasattr(torch, "_grouped_mm")
    return device.type == "cpu" and _torch_grouped_mm_runs("cpu", dtype)


@functools.cache
def _torch_grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch's ``_grouped_mm`` takes ``dtype`` on ``device_type``: probed once,
    and never under capture (:func:`expert_mm` asks only when not capturing)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.zeros(2, 8, dtype=dtype, device=device_type)
        b = torch.zeros(2, 8, 8, dtype=dtype, device=device_type)
        torch._grouped_mm(a, b, offs=torch.tensor([1, 2], dtype=torch.int32, device=device_type))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def hf_expert_tensor(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """transformers' expert tensors to this layout (other names pass unchanged):
    ``experts.gate_up_proj [E, H, 2I] -> experts.w13 [E, 2I, H]``,
    ``experts.down_proj [E, I, H] -> experts.w2 [E, H, I]``."""
    for hf, ours in (("experts.gate_up_proj", "experts.w13"), ("experts.down_proj", "experts.w2")):
        if name.endswith(hf) and tensor.dim() == 3:
            return name[: -len(hf)] + ours, tensor.transpose(1, 2).contiguous()
    return name, tensor


def configure(model: nn.Module, stack_shared: bool | None = None,
              fuse_max_tokens: int | None = None, triton_max_pairs: int | None = None,
              chunk_tokens: int | None = None) -> int:
    """Apply the module defaults above (or the given values) to every MoE layer of a
    loaded model; returns how many layers there are."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        group = SHARED_GROUP_TOKENS if layer.experts.w13_scale is not None else 0  # FP8
        if (STACK_SHARED or group > 0) if stack_shared is None else stack_shared:
            layer.stack_shared()
        layer.fuse_max_tokens = (max(FUSE_MAX_TOKENS, group) if fuse_max_tokens is None
                                 else fuse_max_tokens)
        layer.triton_max_pairs = (TRITON_PAIRS_PER_EXPERT * layer.num_experts
                                  if triton_max_pairs is None else triton_max_pairs)
        layer.chunk_tokens = MOE_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    return len(layers)


class Experts(nn.Module):
    """Stacked expert weights ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (+ FP8 scales).

    Tensor parallel: ``tp.moe == "tp"`` keeps every expert with 1/N of its inner size
    (gate and up rows sliced alike, and their scales; ``w2`` by columns); "ep" keeps
    experts ``[rank * E / N, (rank + 1) * E / N)`` whole."""

    def __init__(self, num_experts: int, hidden: int, inner: int, tp: TPGroup = SINGLE):
        super().__init__()
        n, r = tp.size, tp.rank
        if n > 1 and tp.moe == "ep":
            num_experts //= n
            by_expert = ShardRule(0, n, r)
            self.shard_rules = dict.fromkeys(("w13", "w2", "w13_scale", "w2_scale"), by_expert)
        elif n > 1:
            inner //= n
            self.shard_rules = {"w13": ShardRule(1, n, r, parts=2), "w2": ShardRule(2, n, r),
                                "w13_scale": ShardRule(1, n, r, parts=2)}
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inner))
        # Per-output-channel float32 scales of float8 weights ([E, 2I], [E, H]); a
        # quantized loader assigns them (then they are buffers), float weights have none.
        self.register_buffer("w13_scale", None)
        self.register_buffer("w2_scale", None)

    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None


class SharedExpert(GatedMLPBase):
    """transformers' ``Llama4TextMLP`` (names as in the checkpoint); tensor parallel: this
    rank's slice of the inner size, its output a partial sum (the MoE layer reduces)."""

    def __init__(self, hidden: int, inner: int, act: nn.Module, tp: TPGroup = SINGLE):
        super().__init__()
        self.act = act
        self.gate_proj = column_parallel(hidden, inner, False, tp)
        self.up_proj = column_parallel(hidden, inner, False, tp)
        self.down_proj = row_parallel(inner, hidden, False, tp)

    def forward(self, x):
        return self.down_proj(self.gated(x))


class MoE(nn.Module):
    """Llama-4 MoE block: ``shared(x) + sum_k expert_k(score_k * x)`` over the top-k experts.

    Tensor parallel (``tp``): the router is whole on every rank, so every rank routes
    every token alike; a rank's experts ("tp": slices of all, "ep": its whole experts)
    and its shared-expert slice give a partial sum -- pairs routed to another rank's
    experts add 0 here -- and one all-reduce completes the layer."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, inner: int, act: nn.Module,
                 fuse_max_tokens: int = 0, tp: TPGroup = SINGLE):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{num_experts}, got {top_k}")
        self.num_experts, self.top_k, self.act, self.tp = num_experts, top_k, act, tp
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, inner, tp)
        #: This rank's experts are global ids [first_expert, first_expert + num_local).
        self.num_local = self.experts.w13.shape[0]
        self.first_expert = tp.rank * self.num_local if self.num_local != num_experts else 0
        self.shared_expert: SharedExpert | None = SharedExpert(hidden, inner, act, tp)
        self.stacked = False            # shared expert is slot E of the stacks
        self.fuse_max_tokens = fuse_max_tokens
        # Steps of at most this many (token, expert) pairs use moe_triton's kernel where it
        # runs; 0 = never (the default until the benchmark shows where it pays).
        self.triton_max_pairs = 0
        self.chunk_tokens = 0           # longer steps run in slices (MOE_CHUNK_TOKENS)

    @classmethod
    def from_config(cls, config, act: nn.Module, **kwargs) -> MoE:
        return cls(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                   config.intermediate_size, act, **kwargs)

    @torch.no_grad()
    def stack_shared(self) -> bool:
        """Move the shared expert into slot E of ``w13``/``w2`` (one copy of the stacks).
        Float weights of the experts' dtype, or FP8 ones (with their per-channel scales,
        the experts' activation cap, one rank); returns whether it stacked.

        Exact: slot E's rows are the shared expert's rows, and its input the experts'
        quantization of ``x`` with score 1 (``x * 1`` is ``x``), the bits its own layer
        quantizes; only the split of the sums over K can differ."""
        ex, sh = self.experts, self.shared_expert
        if self.stacked or sh is None:
            return self.stacked
        parts = ((sh.gate_up_proj,) if sh.gate_up_proj is not None
                 else (sh.gate_proj, sh.up_proj))  # not fused at load
        linears = (*parts, sh.down_proj)
        s13, s2 = ex.w13_scale, ex.w2_scale
        fp8 = s13 is not None and s2 is not None
        if fp8 and (self.tp.size > 1 or not all(
                isinstance(m, Fp8Linear) and m.bias is None
                and m.act_scale_ub == getattr(ex, "act_scale_ub", None) for m in linears)):
            return self.stacked
        weight = [m.get_parameter("weight") for m in linears]
        if any(w.dtype != ex.w13.dtype for w in weight) \
                or sum(w.shape[0] for w in weight[:-1]) != ex.w13.shape[1]:  # "ep"
            return self.stacked
        # Both new stacks exist before either old one is freed, then the freed ones go
        # back to the device: an old w13 freed first was split by the new w2 (smaller), and
        # the rest of its segment could never be returned.  Full-size Scout FP8 stranded
        # 26 GiB that way, which the memory profile took for non-torch memory and the KV
        # pool lost (14 requests of 2304 tokens fit instead of ~300; BENCHMARKS.md).
        if ex.w13.is_cuda:  # cached blocks go back first: the stacks get segments of their own
            torch.cuda.empty_cache()
        w13 = stack([ex.w13, stack([*weight[:-1]]).unsqueeze(0)])
        w2 = stack([ex.w2, weight[-1].unsqueeze(0)])
        ex.w13 = nn.Parameter(w13, requires_grad=False)
        ex.w2 = nn.Parameter(w2, requires_grad=False)
        if s13 is not None and s2 is not None:
            scales = [m.weight_scale.reshape(-1).float() for m in linears]
            ex.w13_scale = torch.cat([s13, torch.cat(scales[:-1]).unsqueeze(0)])
            ex.w2_scale = torch.cat([s2, scales[-1].unsqueeze(0)])
        self.shared_expert, self.stacked = None, True
        if w13.is_cuda:  # the old stacks' whole segments, before the next layer splits them
            del w13, w2, weight, linears, parts, sh
            torch.cuda.empty_cache()
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = self.chunk_tokens
        if not step or x.shape[0] <= step:
            return self._block(x)
        out = torch.empty_like(x)
        for start in range(0, x.shape[0], step):  # a long prefill's few slices, no sync
            out[start:start + step] = self._block(x[start:start + step])
        return out

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        ex, num_groups = self.experts, self.num_local
        fused = self.stacked and tokens <= self.fuse_max_tokens
        slots = self.top_k + int(fused)
        # The shared expert first (apart from the GEMMs' groups): its [T, H] output is all it
        # leaves, and the combine adds it (in its kernel where COMBINE_RANKED runs).  The
        # peak is the same either way round for top-1 (its [T, 2I] product beside the
        # routed [T, H] then, the routed product beside its output now), and no routed
        # intermediate outlives the combine (tests/test_activation_lifetimes.py).
        shared = None if fused else self._shared(x)
        elsewhere = None
        if num_groups == self.num_experts:
            order, offs, token, pair_score, rank = routing.pairs(x, self.router, self.top_k,
                                                                 num_groups, fused)
        else:  # "ep": other ranks' experts sort past the end
            expert, score = routing.route(x, self.router, self.top_k)
            expert = expert - self.first_expert
            elsewhere = (expert < 0) | (expert >= num_groups)
            expert = expert.masked_fill(elsewhere, num_groups)
            order, offs, token, pair_score = routing.sort_pairs_torch(expert, score,
                                                                      num_groups, fused)
            rank = None
        num_groups += int(fused)
        # Each intermediate is dropped as soon as the next exists (``del``), and the gate's
        # activation and the product are one tensor (gated_act): the memory profile reserves
        # this block's peak for good (engine/memory.py), and on full-size Scout FP8 the
        # gate/up product held on through the shared expert (benchmarks/activation_peak.py).
        w13, w2 = ex.w13[:num_groups], ex.w2[:num_groups]
        s13, s2 = ex.w13_scale, ex.w2_scale
        if s13 is not None and s2 is not None:  # FP8: slot E's scales only when it runs
            s13, s2 = s13[:num_groups], s2[:num_groups]
        small = order.shape[0] <= self.triton_max_pairs
        ub = getattr(ex, "act_scale_ub", None)
        routed_in: torch.Tensor | QuantRows
        if gather_quant_available(x, w13):
            routed_in = QuantRows(*quantize_rows(x, ub, token, pair_score), x.dtype)
        else:
            routed_in = x[token] * pair_score.view(-1, 1)
        # a group holds at most one pair of each token (top-k experts are distinct)
        gate_up = expert_mm(routed_in, w13, offs, s13, small, ub, group_rows=tokens)
        del routed_in
        # "tp": each rank holds a slice of every pair's w2 input (routing is the same on
        # every rank, so row i is the same pair everywhere): FP8 scales it by its full amax
        split = self.tp.all_reduce_max if self.tp.size > 1 and elsewhere is None else None
        inner = activation_rows(gate_up, w2, self.act, ub, split)
        del gate_up
        rows = expert_mm(inner, w2, offs, s2, small, ub, split, group_rows=tokens)
        del inner
        # plus the shared expert's rows: torch's ``shared + routed`` (routed rounded first)
        out = routing.combine(rows, order, rank, tokens, slots, elsewhere, shared)
        del rows, shared
        return self.tp.all_reduce(out) if self.tp.size > 1 else out

    def _shared(self, x):
        if self.shared_expert is not None:  # not stacked
            return self.shared_expert(x)
        ex = self.experts
        s13, s2 = ex.w13_scale, ex.w2_scale
        if s13 is None or s2 is None:
            return F.linear(gated_act(F.linear(x, ex.w13[-1]), self.act), ex.w2[-1])
        ub = getattr(ex, "act_scale_ub", None)  # FP8: as the shared expert's own layers
        gate_up = fp8_linear(x, ex.w13[-1], s13[-1], act_scale_ub=ub)
        inner = activation_rows(gate_up, ex.w2, self.act, ub, None, SHARED_SILU_QUANT)
        del gate_up
        return fp8_linear(inner, ex.w2[-1], s2[-1], act_scale_ub=ub)


def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` along dim 0, float8 tensors as their bytes (a copy every device's cat
    does for uint8, as models/fused.py concatenates FP8 projections)."""
    if tensors[0].dtype not in FP8_DTYPES:
        return torch.cat(tensors)
    return torch.cat([t.view(torch.uint8) for t in tensors]).view(tensors[0].dtype)
