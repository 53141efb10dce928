"""FP8 GEMMs at decode sizes: moe_triton's small-M kernel against torch's path, side by side.

Two parts, one run (GPU):

* **Kernels**, Scout's shapes: the dense shared-expert projections (gate/up: N = 8192,
  K = 5120; down: N = 5120, K = 8192) at M = 1..256 rows, and the routed experts
  (``w13 [16, 16384, 5120]``, ``w2 [16, 5120, 8192]``) at 1..256 (token, expert) pairs
  spread round-robin over the 16 experts (trained routers spread tokens; every expert
  that gets a row is read).  torch's path is what ``quant.fp8_linear`` /
  ``fp8_grouped_mm`` run on CUDA: ``quantize_per_token`` (amax, scale, cast kernels), then
  ``torch._scaled_mm`` / ``torch._scaled_grouped_mm``.  Each is captured in a CUDA graph of
  ``REPLAYS`` calls, so launch gaps are not counted for either.  Floor: the weight bytes
  touched (plus activations and outputs) at the copy rate measured in the same run.
  A third column, "quant", is torch's path with its activation quantization in
  ``quant_triton``'s one kernel instead of torch's chain of small ones; "tiles" is the
  split-K kernel at ``moe_triton.TUNED_TILES``' tile for the shape, beside "triton" at
  the default tile.
* **Engine**: full-size Scout FP8 (dummy weights, ``benchmarks.decode_floor``'s model)
  decode steps at the given batches, 1k contexts, one engine per variant of
  ``--engine-paths`` (``ENGINE_PATHS``: projections unfused, torch's path, with the
  quantization kernel, with the GEMM kernel, the defaults (both kernels), the defaults
  with the elementwise-tail kernels, and those with the FP8 kernel's in-kernel K-slice sum
  (reduce), its routed-expert grid (slots) or both), one after the other, on spread routing
  (``floors.BalancedRouting``; the experts touched per layer are in each row).

    python -m benchmarks.fp8_small_m --out OUT [--engine-batches 1 16 64]
        [--engine-paths unfused torch quant triton defaults tail reduce slots slots_reduce]
        [--sweep 1 16 64] [--tune 1 16] [--gemv-tune 1 2 4 16 32] [--gemv16-tune]

``--sweep`` times the split-K kernel's tile width and split choices; ``--tune`` its tile
width, K-step, warps and pipeline stages (``TUNE``) at the automatic split, each row with
the fastest choice and its speed-up over the defaults (a choice that does not fit the
SM's shared memory is recorded as such and skipped); ``--gemv-tune`` times
``gemv_triton.fp8_gemv``'s tiles (``GEMV_TUNE``) beside the split-K kernel where every
group has few rows (``gemv_triton.MAX_ROWS`` is where the engine takes it);
``--gemv16-tune`` times its 16-bit form (``gemv_triton.gemv16``) beside cuBLAS on Scout's
one-row bf16 projections.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import (
    base_parser,
    cuda_time_ms,
    format_table,
    guarded,
    measure_copy_bytes_per_s,
    write_json,
)
from chunklocal.models.moe_triton import DEFAULT_TILE

REPLAYS = 20
DENSE = {"gate_up": (8192, 5120), "down": (5120, 8192)}
GROUPED = {"w13": (16, 16384, 5120), "w2": (16, 5120, 8192)}


def weights(e, n, k, device):
    w = torch.randn(e, n, k, device=device).div_(16).to(torch.float8_e4m3fn)
    return w, torch.rand(e, n, device=device) * 1e-2 + 1e-3


def graphed(fn, device):
    """``fn`` replayed REPLAYS times from one CUDA graph (eager on the CPU smoke)."""
    if device.type != "cuda":
        return fn
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPLAYS):
            fn()
    return graph.replay


def kernel_rows(device, copy_rate, ms, smoke) -> list[dict]:
    from chunklocal.models import moe_triton

    triton_ok = moe_triton_available(device)
    rows, saved = [], moe_triton.FP8_ENABLED
    moe_triton.FP8_ENABLED = False  # fp8_linear: torch's path; the kernel is called by name
    try:
        dense_rows(rows, device, copy_rate, ms, smoke, triton_ok)
        grouped_rows(rows, device, copy_rate, ms, smoke, triton_ok)
    finally:
        moe_triton.FP8_ENABLED = saved
    return rows


def dense_rows(rows, device, copy_rate, ms, smoke, triton_ok) -> None:
    from chunklocal.models import moe_triton, quant

    for name, (n, k) in DENSE.items():
        n, k = (n // 64, k // 64) if smoke else (n, k)
        w, s = weights(1, n, k, device)
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            paths = {"torch": lambda x=x, w=w, s=s: quant.fp8_linear(x, w[0], s[0])}
            if triton_ok:
                paths["quant"] = with_quant_kernel(paths["torch"])
                paths["triton"] = lambda x=x, w=w, s=s: moe_triton.fp8_grouped_mm_small(
                    x, w[:1], s[:1], None, gemv=False)  # split-K (fp8_gemv: --gemv-tune)
                paths["reduce"] = lambda x=x, w=w, s=s: moe_triton.fp8_grouped_mm_small(
                    x, w[:1], s[:1], None, reduce_in_kernel=True)
                tile = tuned(False, n, k)
                paths["tiles"] = lambda x=x, w=w, s=s, t=tile: moe_triton.fp8_grouped_mm_small(
                    x, w[:1], s[:1], None, **t)
            rows.append(cell(f"dense {name}", m, n * k + m * k * 2 + m * n * 2, paths,
                             device, copy_rate))


def grouped_rows(rows, device, copy_rate, ms, smoke, triton_ok) -> None:
    from chunklocal.models import moe_triton, quant

    for name, (e, n, k) in GROUPED.items():
        n, k = (n // 64, k // 64) if smoke else (n, k)
        w, s = weights(e, n, k, device)
        for m in ms:
            counts = torch.bincount(torch.arange(m) % e, minlength=e)
            offs = counts.cumsum(0).to(torch.int32).to(device)
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            paths = {"torch": lambda x=x, w=w, s=s, o=offs: quant.fp8_grouped_mm(x, w, s, o)}
            if triton_ok:
                paths["quant"] = with_quant_kernel(paths["torch"])
                paths["triton"] = lambda x=x, w=w, s=s, o=offs: moe_triton.fp8_grouped_mm_small(
                    x, w, s, o, gemv=False)
                paths["reduce"] = lambda x=x, w=w, s=s, o=offs: moe_triton.fp8_grouped_mm_small(
                    x, w, s, o, reduce_in_kernel=True)
                paths["slots"] = lambda x=x, w=w, s=s, o=offs: moe_triton.fp8_grouped_mm_small(
                    x, w, s, o, routed_slots_in_kernel=True)
                tile = tuned(True, n, k)
                paths["tiles"] = lambda x=x, w=w, s=s, o=offs, t=tile: \
                    moe_triton.fp8_grouped_mm_small(x, w, s, o, **t)
            touched = int((counts > 0).sum())
            rows.append(cell(f"experts {name}", m, touched * n * k + m * (k + n) * 2, paths,
                             device, copy_rate) | {"experts_touched": touched})


def tuned(grouped: bool, n: int, k: int) -> dict:
    """The keywords of ``moe_triton.TUNED_TILES``' tile for a shape, whatever its switch
    says."""
    from chunklocal.models.moe_triton import tile_for

    return dict(zip(("block_n", "block_k", "num_warps", "num_stages"),
                    tile_for(grouped, n, k, tuned=True), strict=True))


def with_quant_kernel(fn):
    """``fn`` (torch's FP8 path) with its activation quantization in quant_triton's kernel."""
    def run():
        with switches(True, False, True):
            return fn()
    return run


def cell(name, m, nbytes, paths, device, copy_rate) -> dict:
    row = {"gemm": name, "rows": m, "bytes": nbytes,
           "floor_us": nbytes / copy_rate * 1e6}
    for label, fn in paths.items():
        replay = graphed(fn, device)
        if device.type == "cuda":
            us = cuda_time_ms(replay, repeats=10)["median"] * 1e3 / REPLAYS
        else:
            fn()
            us = float("nan")
        row[f"{label}_us"] = us
        row[f"{label}_share"] = row["floor_us"] / us
    for label in ("triton", "quant", "reduce", "slots", "tiles"):
        if f"{label}_us" in row:
            row[f"torch_over_{label}"] = row["torch_us"] / row[f"{label}_us"]
    print(format_table([row]), flush=True)
    return row


#: Tile and split choices of the split-K kernel that ``--sweep`` times (block_n, split_k;
#: None: the kernel's own choice, ``moe_triton.split_k_for``).
SWEEP = [(bn, sk) for bn in (32, 64, 128) for sk in (None, 1, 2, 4, 8, 16)]


def scout_cells(device, ms, smoke):
    """(name, rows, x, w, w_scale, offs, bytes) for Scout's four FP8 GEMM shapes (the dense
    ones as one group, ``offs`` None) at each row count of ``ms``, rows spread round-robin
    over the experts; bytes: the weights of the experts touched, the rows and the output."""
    shapes = {f"dense {k}": (1, *v) for k, v in DENSE.items()}
    shapes |= {f"experts {k}": v for k, v in GROUPED.items()}
    for name, (e, n, k) in shapes.items():
        n, k = (n // 64, k // 64) if smoke else (n, k)
        w, s = weights(e, n, k, device)
        for m in ms:
            counts = torch.bincount(torch.arange(m) % e, minlength=e)
            offs = None if e == 1 else counts.cumsum(0).to(torch.int32).to(device)
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            touched = int((counts > 0).sum())
            yield name, m, x, w, s, offs, touched * n * k + m * (k + n) * 2


def sweep_rows(rows, device, copy_rate, ms, smoke, save) -> None:
    """The split-K kernel at each SWEEP configuration, Scout's four shapes, ``ms`` rows
    (spread round-robin over the experts), appended to ``rows`` and saved one by one (a
    time limit keeps what was measured): the table its defaults are chosen from."""
    from chunklocal.models import moe_triton

    configs = SWEEP[:2] if smoke else SWEEP
    for name, m, x, w, s, offs, nbytes in scout_cells(device, ms, smoke):
        e, n, k = w.shape
        paths = {f"bn{bn}_split{'auto' if sk is None else sk}":
                 (lambda x=x, w=w, s=s, o=offs, bn=bn, sk=sk:
                  moe_triton.fp8_grouped_mm_small(x, w, s, o, block_n=bn, split_k=sk))
                 for bn, sk in configs}
        row = cell(name, m, nbytes, paths, device, copy_rate)
        row["split_k_auto"] = moe_triton.split_k_for(
            m, e, n, k, 64, 256, moe_triton.device_sm_count(device))
        rows.append(row)
        save()


#: (block_n, block_k, num_warps, num_stages) that ``--tune`` times; the first is the
#: kernel's default (``moe_triton.DEFAULT_TILE``).
TUNE = [DEFAULT_TILE] + [(bn, bk, w, st) for bn in (32, 64, 128) for bk in (128, 256, 512)
                            for w, st in ((4, 3), (4, 4), (4, 6), (8, 4), (8, 6))
                            if (bn, bk, w, st) != DEFAULT_TILE]


def tune_label(bn, bk, warps, stages) -> str:
    return f"bn{bn}_bk{bk}_w{warps}_s{stages}"


def tune_rows(rows, device, copy_rate, ms, smoke, save) -> None:
    """The split-K kernel at each TUNE choice (the split its own), Scout's four shapes at
    ``ms`` rows spread round-robin over the experts; per row the fastest choice and its
    speed-up over the default, saved row by row."""
    from chunklocal.models import moe_triton

    configs = TUNE[:2] if smoke else TUNE
    for name, m, x, w, s, offs, nbytes in scout_cells(device, ms, smoke):
        paths, unfit = {}, []
        for bn, bk, warps, stages in configs:
            def fn(x=x, w=w, s=s, o=offs, bn=bn, bk=bk, warps=warps, stages=stages):
                return moe_triton.fp8_grouped_mm_small(x, w, s, o, block_n=bn, block_k=bk,
                                                       num_warps=warps, num_stages=stages)
            try:
                fn()  # compiles; a tile over the SM's shared memory fails here
            except Exception as err:  # triton's OutOfResources and kin: not a result
                unfit.append(f"{tune_label(bn, bk, warps, stages)}: {type(err).__name__}")
                continue
            paths[tune_label(bn, bk, warps, stages)] = fn
        row = cell(name, m, nbytes, paths, device, copy_rate)
        timed = {label: row[f"{label}_us"] for label in paths}
        best = min(timed, key=timed.get)
        default = tune_label(*TUNE[0])
        row.update(unfit=unfit, best=best, best_share=row[f"{best}_share"],
                   default_over_best=timed[default] / timed[best])
        rows.append(row)
        save()


#: (block_n, block_k, num_warps, partial) of ``gemv_triton.fp8_gemv`` that ``--gemv-tune``
#: times (the first is ``gemv_triton.DEFAULT_TILE`` without partial sums; ``partial``:
#: ``gemv_triton.PARTIAL_ENABLED``'s form, a label ending ``_part``).
GEMV_TUNE = [(16, 512, 4, False), (16, 256, 4, False), (8, 256, 4, False),
             (16, 512, 8, False), (32, 512, 8, False), (8, 512, 2, False),
             (8, 1024, 4, False), (16, 1024, 8, False), (32, 256, 4, False),
             (16, 512, 4, True), (16, 1024, 4, True), (32, 512, 4, True), (32, 1024, 8, True),
             (8, 512, 2, True), (16, 256, 4, True),
             # one weight row a warp: each row's bytes converted once a thread, not once for
             # every weight row the thread holds (sm_90 compile: 48-64 registers)
             (4, 1024, 4, True), (4, 2048, 4, True), (8, 2048, 8, True)]


#: (block_n, block_k, num_warps, num_stages) of the tensor-core form
#: (``gemv_triton.MMA_ENABLED``; the first is ``gemv_triton.MMA_TILE``), ``--gemv-tune``'s
#: e4m3 rows only, labels ending ``_mma``: wgmma's 64 weight rows, or 128 with 8 warps.
GEMV_MMA_TUNE = [(64, 256, 4, 3), (64, 128, 4, 4), (64, 512, 4, 2), (64, 256, 4, 4),
                 (128, 256, 8, 3), (128, 128, 8, 4)]


def gemv_label(tile) -> str:
    kw = gemv_keywords(tile)
    label = f"gemv_bn{kw['block_n']}_bk{kw['block_k']}_w{kw['num_warps']}"
    if kw.get("mma"):
        return f"{label}_s{kw['num_stages']}_mma"
    return f"{label}{'_part' if kw['partial'] else ''}"


def gemv_keywords(tile) -> dict:
    """A GEMV_TUNE entry as ``fp8_gemv`` / ``gemv16``'s tile keywords, or a GEMV_MMA_TUNE
    one as ``fp8_gemv``'s with ``mma``."""
    if isinstance(tile[3], bool):
        return dict(zip(("block_n", "block_k", "num_warps", "partial"), tile, strict=True))
    return dict(zip(("block_n", "block_k", "num_warps", "num_stages"), tile, strict=True),
                mma=True)


def best_gemv(row: dict, paths: dict, baseline: str) -> dict:
    """The fastest GEMV tile of a timed row, its share of the floor, and ``baseline``'s
    time over it (``<baseline>_over_best``)."""
    gemvs = {label: row[f"{label}_us"] for label in paths if label.startswith("gemv")}
    best = min(gemvs, key=gemvs.get)
    return {"best": best, "best_share": row[f"{best}_share"],
            f"{baseline}_over_best": row[f"{baseline}_us"] / gemvs[best]}


#: Largest difference a GEMV tile's output may show from the split-K kernel's, over the
#: largest magnitude of the latter: both take the same exact float32 products of the same
#: quantized row, sum them in other orders and round once to bf16 (2^-8 relative), so a
#: value may differ by a unit in its last place; a wrong tile is off by far more.
GEMV_TOLERANCE = 2.0 ** -6


def gemv_tune_rows(rows, device, copy_rate, ms, smoke, save, errors) -> None:
    """``gemv_triton.fp8_gemv`` (rows quantized by ``quant_triton``'s kernel first, as
    ``fp8_grouped_mm_small`` does) at each GEMV_TUNE tile beside the split-K kernel at its
    default and tuned tiles, Scout's four shapes at ``ms`` rows (spread round-robin over
    the experts: a group holds ``ceil(m / 16)``; a group's second row re-reads its slab);
    per row the fastest GEMV tile and the split-K default over it, saved row by row.
    Each tile's output is also checked against the split-K kernel's once (``*_err``:
    the largest difference over the largest magnitude); one past :data:`GEMV_TOLERANCE`
    is appended to ``errors``."""
    from chunklocal.models import gemv_triton, moe_triton
    from chunklocal.models.quant_triton import quantize_rows

    configs = ([GEMV_TUNE[0], GEMV_TUNE[-1], GEMV_MMA_TUNE[0]] if smoke
               else GEMV_TUNE + GEMV_MMA_TUNE)
    for name, m, x, w, s, offs, nbytes in scout_cells(device, ms, smoke):
        group_rows = m if offs is None else -(-m // w.shape[0])
        tile = tuned(offs is not None, *w.shape[1:])
        paths = {"split": lambda x=x, w=w, s=s, o=offs: moe_triton.fp8_grouped_mm_small(
                     x, w, s, o, gemv=False),
                 "split_tuned": lambda x=x, w=w, s=s, o=offs, t=tile:
                     moe_triton.fp8_grouped_mm_small(x, w, s, o, gemv=False, **t)}
        for tile in configs:
            def fn(x=x, w=w, s=s, o=offs, tile=tile):
                xq, xs = quantize_rows(x)
                return gemv_triton.fp8_gemv(xq, xs, x.dtype, w, s, o, **gemv_keywords(tile))
            paths[gemv_label(tile)] = fn
        row = cell(name, m, nbytes, paths, device, copy_rate)
        row.update(group_rows=group_rows, **best_gemv(row, paths, "split"))
        want = paths["split"]().float()
        scale = float(want.abs().max()) or 1.0
        for label, fn in paths.items():
            if label.startswith("gemv_"):
                err = float((fn().float() - want).abs().max()) / scale
                row[f"{label}_err"] = err
                if err > GEMV_TOLERANCE:
                    errors.append(f"{name}, {m} rows, {label}: off by {err:.3g} of the "
                                  "split-K kernel's largest value")
        rows.append(row)
        save()


#: Scout's one-row 16-bit projections ``(N, K)``: the fused q/k/v, o_proj, the LM head.
BF16_SHAPES = {"qkv": (7168, 5120), "o_proj": (5120, 5120), "lm_head": (202048, 5120)}


def gemv16_tune_rows(rows, device, copy_rate, smoke, save) -> None:
    """One bf16 row through cuBLAS (``F.linear``, split-K and its reduce at M = 1) beside
    ``gemv_triton.gemv16`` at each GEMV_TUNE tile, Scout's three 16-bit projections;
    per shape the fastest tile and cuBLAS over it, saved shape by shape."""
    import torch.nn.functional as F

    from chunklocal.models import gemv_triton

    configs = [GEMV_TUNE[0], GEMV_TUNE[-1]] if smoke else GEMV_TUNE
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter
    for name, (n, k) in BF16_SHAPES.items():
        n, k = (n // 64, k // 64) if smoke else (n, k)
        gen = torch.Generator(device=device).manual_seed(n)
        w = torch.randn(n, k, device=device, generator=gen).mul_(k ** -0.5).to(dtype)
        x = torch.randn(1, k, device=device, generator=gen).to(dtype)
        paths = {"cublas": lambda x=x, w=w: F.linear(x, w)}
        for tile in configs:
            paths[gemv_label(tile)] = lambda x=x, w=w, tile=tile: gemv_triton.gemv16(
                x, w, **gemv_keywords(tile))
        row = cell(f"bf16 {name}", 1, n * k * 2 + (k + n) * 2, paths, device, copy_rate)
        row.update(best_gemv(row, paths, "cublas"))
        rows.append(row)
        save()


#: Engine variants: (FUSE_PROJECTIONS, the FP8 GEMM kernel, the quantization kernel, the
#: elementwise-tail kernels of models/norm_triton.py, the FP8 kernel adding its K-slices
#: itself: moe_triton.SPLITK_REDUCE_IN_KERNEL, its grid of routed experts only:
#: moe_triton.ROUTED_SLOTS_ENABLED).
ENGINE_PATHS = {"unfused": (False, False, False, False), "torch": (True, False, False, False),
                "quant": (True, False, True, False), "triton": (True, True, False, False),
                "defaults": (True, True, True, False), "tail": (True, True, True, True),
                "reduce": (True, True, True, True, True),
                "slots": (True, True, True, True, False, True),
                "slots_reduce": (True, True, True, True, True, True)}


@contextlib.contextmanager
def switches(fuse: bool, gemm: bool, quant_kernel: bool, tail: bool = False,
             reduce: bool = False, slots: bool = False):
    """The module switches of one variant, restored afterwards (read when an engine loads
    and when a kernel runs, so a CUDA graph captures what they say)."""
    from chunklocal.models import fused, moe_triton, norm_triton, quant_triton

    names = ((fused, "FUSE_PROJECTIONS"), (moe_triton, "FP8_ENABLED"),
             (quant_triton, "QUANT_ENABLED"), (norm_triton, "NORM_ENABLED"),
             (moe_triton, "SPLITK_REDUCE_IN_KERNEL"), (moe_triton, "ROUTED_SLOTS_ENABLED"))
    saved = [getattr(module, name) for module, name in names]
    for (module, name), value in zip(names, (fuse, gemm, quant_kernel, tail, reduce, slots),
                                     strict=True):
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in zip(names, saved, strict=True):
            setattr(module, name, value)


def engine_rows(rows, batches, steps, device, rates, save, errors, paths) -> None:
    """decode_floor's cells on full-size Scout FP8, one engine per variant of ``paths``
    (ENGINE_PATHS), one after the other."""
    from argparse import Namespace

    from benchmarks import decode_floor, floors

    args = Namespace(steps=steps, profile=True, profile_batches=batches)  # class tables
    with tempfile.TemporaryDirectory() as tmp, floors.BalancedRouting():
        path = decode_floor.write_config(Path(tmp) / "scout-fp8", "scout-fp8")
        for label in paths:
            with switches(*ENGINE_PATHS[label]):
                llm = decode_floor.make_llm_with_kv(path, device, max(batches),
                                                    1024 + 3 * steps + 96)
                for batch in batches:
                    row = guarded(f"{label} b{batch}", lambda b=batch, e=llm: (
                        decode_floor.decode_cell(e, "scout-fp8", b, 1024, args, rates, device)),
                        errors)
                    if row:
                        rows.append({"fp8_gemms": label, **row})
                        print(format_table([{k: v for k, v in rows[-1].items()
                                             if not isinstance(v, dict | list)}]), flush=True)
                        save()
                llm.shutdown()
                del llm
            gc.collect()
            torch.cuda.empty_cache()


def moe_triton_available(device) -> bool:
    from chunklocal.models import moe_triton

    return moe_triton.available(torch.empty(1, dtype=torch.bfloat16, device=device))


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--engine-batches", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sweep", type=int, nargs="*", default=None, metavar="ROWS",
                        help="also time the split-K kernel at every SWEEP tile/split choice "
                             "for these row counts (e.g. --sweep 1 16 64)")
    parser.add_argument("--tune", type=int, nargs="*", default=None, metavar="ROWS",
                        help="also time the split-K kernel at every TUNE tile, K-step, "
                             "warps and stages choice for these row counts (e.g. --tune 1 16)")
    parser.add_argument("--gemv-tune", type=int, nargs="*", default=None, metavar="ROWS",
                        help="also time gemv_triton.fp8_gemv at every GEMV_TUNE tile beside "
                             "the split-K kernel for these row counts (e.g. --gemv-tune 1 2 4)")
    parser.add_argument("--gemv16-tune", action="store_true",
                        help="also time gemv_triton.gemv16 at every GEMV_TUNE tile beside "
                             "cuBLAS on Scout's one-row bf16 projections")
    parser.add_argument("--engine-paths", nargs="+", choices=sorted(ENGINE_PATHS),
                        default=["defaults", "tail"],
                        help="engine variants, in order (ENGINE_PATHS): unfused projections, "
                             "torch's FP8 path, with the quantization kernel, with the GEMM "
                             "kernel, both kernels (the defaults), and the defaults with the "
                             "elementwise-tail kernels (models/norm_triton.py)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        parser.error("the full-size run needs CUDA; on the CPU only --smoke works")
    copy_rate = measure_copy_bytes_per_s(device) if device.type == "cuda" else 1e11
    payload = {"rates": {"copy_bytes_per_s": copy_rate}, "kernels": [], "engine": [],
               "errors": []}
    name = "fp8_small_m_smoke" if args.smoke else "fp8_small_m"

    def save():
        write_json(name, payload, args.out)

    payload["kernels"] = kernel_rows(device, copy_rate, [1, 3] if args.smoke else args.rows,
                                     args.smoke)
    save()
    if args.sweep and moe_triton_available(device):
        payload["sweep"] = []
        sweep_rows(payload["sweep"], device, copy_rate, args.sweep, args.smoke, save)
    if args.tune and moe_triton_available(device):
        payload["tune"] = []
        tune_rows(payload["tune"], device, copy_rate, args.tune, args.smoke, save)
    if args.gemv_tune and moe_triton_available(device):
        payload["gemv_tune"] = []
        gemv_tune_rows(payload["gemv_tune"], device, copy_rate, args.gemv_tune, args.smoke,
                       save, payload["errors"])
    if args.gemv16_tune and moe_triton_available(device):
        payload["gemv16_tune"] = []
        gemv16_tune_rows(payload["gemv16_tune"], device, copy_rate, args.smoke, save)
    if device.type == "cuda" and args.engine_batches:
        from benchmarks.common import measure_matmul_flops

        rates = {"copy_bytes_per_s": copy_rate,
                 "matmul_flops_per_s": measure_matmul_flops(device)}
        engine_rows(payload["engine"], args.engine_batches, args.steps, device, rates, save,
                    payload["errors"], args.engine_paths)
    save()
    return 0 if not payload["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
