"""Attention over FP8 KV pages at long contexts against float64: issue 23, item 2.

One request per cell, Scout's attention geometry (40 query heads, 8 KV heads, head_dim 128,
pages of 16), keys at 1k, 32k and 128k (``--lengths``), global and chunked (8192) layers,
two query shapes: a decode step (the last position) and a prefill chunk (the last 64
positions).  K and V are random with a few outlier channels (as real keys have), their
scales calibrated as ``calculate_kv_scales`` sets them (max|K| / 200, max|V| / 100), the
queries scaled so that scores have a standard deviation of about 3 (peaked softmaxes, where
e4m3's rounding of the keys shows).  The backend is the engine's (FlashInfer on CUDA: bf16
queries over e4m3 pages; the torch reference backend on the CPU smoke), run on:

* the FP8 pages: error against float64 attention over the *dequantized* pages (the
  kernel's own accumulation, the problem vLLM saw at 128k with FA3's FP8 path), and
  against float64 over the same keys in bf16 (what FP8 KV costs against a bf16 cache);
* the same keys in bf16 pages: error against float64 over the bf16 keys (the kernel's
  bf16 accumulation: the yardstick for the first column).

Errors: max |out - ref| / max |ref| and the relative RMS, per cell.  The JSON is written
after every cell, so a time limit keeps what was measured.

    python -m benchmarks.fp8_kv_accuracy --out OUT [--lengths 1024 32768 131072]
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from benchmarks.common import base_parser, format_table, guarded, write_json

HQ, HKV, D, BS, CHUNK = 40, 8, 128, 16, 8192
PREFILL_QUERIES = 64


def keys_values(length, seed, device):
    gen = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(length, HKV, D, device=device, generator=gen)
    k[..., :4] *= 8  # outlier channels: the amax (so the scale) is theirs
    v = torch.randn(length, HKV, D, device=device, generator=gen) * 2
    return k, v


def paged(x, table, num_pages):
    pages = x.new_zeros(num_pages, BS, *x.shape[1:])
    flat = pages.view(-1, *x.shape[1:])
    slots = (torch.as_tensor(table[0], device=x.device)[:, None] * BS
             + torch.arange(BS, device=x.device)).reshape(-1)[: x.shape[0]]
    flat[slots] = x
    return pages


def errors(out, ref) -> tuple[float, float]:
    diff = out.double() - ref
    return (float(diff.abs().max() / ref.abs().max()), float(diff.norm() / ref.norm()))


def cell(length, chunk, queries, device) -> dict:
    from chunklocal.backends.base import EngineLimits
    from chunklocal.backends.factory import make_backend as backend_for
    from chunklocal.kv_quant import FP8_KV_DTYPE, dequantize, quantize
    from chunklocal.kv_spec import ChunkedLocalAttentionSpec, FullAttentionSpec, Kind
    from chunklocal.reference import reference_attention

    def make_backend(dtype):  # the engine's choice: FlashInfer on CUDA, else the reference
        spec = (ChunkedLocalAttentionSpec(BS, HKV, D, dtype, attention_chunk_size=chunk)
                if chunk else FullAttentionSpec(BS, HKV, D, dtype))
        return backend_for("flashinfer" if device.type == "cuda" else "torch", spec,
                           EngineLimits(1, max(queries, 1), length, BS), num_q_heads=HQ,
                           dtype=torch.bfloat16, device=device)

    k, v = keys_values(length, seed=length + (chunk or 0), device=device)
    k_scale, v_scale = float(k.abs().max()) / 200, float(v.abs().max()) / 100
    width = -(-length // BS)
    num_pages = width + 1  # page 0: the scratch page, never in a table
    rng = np.random.default_rng(length)
    table = (1 + rng.permutation(width)).astype(np.int32).reshape(1, width)
    gen = torch.Generator(device=device).manual_seed(7)
    # score std ~3: q . k over D = 128 with |k| ~ 1-8 per channel
    q = (torch.randn(queries, HQ, D, device=device, generator=gen) * 3 / (D ** 0.5 * 1.6))
    qsl, seq = np.array([0, queries]), np.array([length])
    scale = D ** -0.5
    kind = Kind.CHUNKED if chunk else Kind.GLOBAL
    qb = q.to(torch.bfloat16)
    dt = torch.float32 if device.type == "cpu" else torch.bfloat16

    def ref(kc, vc):
        return reference_attention(qb.double(), kc.double(), vc.double(), qsl, seq, table,
                                   chunk_size=chunk, scale=scale)

    kq, vq = quantize(k, k_scale), quantize(v, v_scale)
    k_pages, v_pages = paged(kq, table, num_pages), paged(vq, table, num_pages)
    fp8 = make_backend(FP8_KV_DTYPE)
    out8 = fp8.forward(fp8.build(qsl, seq, table), qb.to(dt), k_pages, v_pages, scale,
                       kind=kind, k_scale=k_scale, v_scale=v_scale)
    vs_dequant = errors(out8, ref(dequantize(k_pages, k_scale), dequantize(v_pages, v_scale)))
    kb, vb = k.to(torch.bfloat16), v.to(torch.bfloat16)
    exact = ref(paged(kb, table, num_pages), paged(vb, table, num_pages))
    vs_unquantized = errors(out8, exact)
    bf16 = make_backend(dt)
    out16 = bf16.forward(bf16.build(qsl, seq, table), qb.to(dt),
                         paged(kb.to(dt), table, num_pages), paged(vb.to(dt), table, num_pages),
                         scale, kind=kind)
    vs_bf16_pages = errors(out16, exact)
    return {"keys": length, "layer": "chunked" if chunk else "global", "queries": queries,
            "k_scale": k_scale, "v_scale": v_scale,
            "fp8_vs_dequantized_max": vs_dequant[0], "fp8_vs_dequantized_rms": vs_dequant[1],
            "fp8_vs_unquantized_max": vs_unquantized[0],
            "fp8_vs_unquantized_rms": vs_unquantized[1],
            "bf16_pages_max": vs_bf16_pages[0], "bf16_pages_rms": vs_bf16_pages[1]}


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 32768, 131072])
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        parser.error("the full-size run needs CUDA; on the CPU only --smoke works")
    lengths = [100, 300] if args.smoke else args.lengths
    chunk_size = 64 if args.smoke else CHUNK
    rows, errs = [], []
    name = "fp8_kv_accuracy_smoke" if args.smoke else "fp8_kv_accuracy"
    for length in lengths:
        for chunk in (None, chunk_size):
            for queries in (1, min(PREFILL_QUERIES, length)):
                row = guarded(f"{length} {chunk} {queries}",
                              lambda n=length, c=chunk, m=queries: cell(n, c, m, device), errs)
                if row:
                    rows.append(row)
                    print(format_table([row]), flush=True)
                write_json(name, {"rows": rows, "errors": errs}, args.out)
    return 1 if errs else 0


if __name__ == "__main__":
    sys.exit(main())
