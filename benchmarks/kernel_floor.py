"""Q1 + Q2: chunked-local attention against the kernel floor and the alternatives (GPU).

Ceilings measured in the same run: device-to-device copy (bytes read + written)
and a bf16 8192^3 matmul.  Prefill cases report useful TFLOP/s (only unmasked
pairs: 4 * D * Hq * keys seen, summed over query rows) as a fraction of the
matmul rate (target >= 70 %); decode cases report bytes/s over the KV actually
read as a fraction of the copy rate (target >= 85 %).  The alternatives run on
the same inputs: FlexAttention with a chunked block mask (torch.compile), SDPA
with a dense boolean mask, and full causal attention without chunking (the same
chunklocal kernel on the undivided requests); each is reported as its time over
chunklocal's.  Every output is checked against float64 on sampled rows.

40/8 heads, head dim 128, bf16, page 16, c = 8192 (smoke: c = 256, tiny).
"""

from __future__ import annotations

import sys

import torch

from benchmarks import common, dense
from benchmarks import workloads as wl
from benchmarks.common import cuda_time_ms, format_table, guarded, write_json
from benchmarks.steps import make_step_builders

KV_BYTES_PER_TOKEN = 2 * wl.NUM_KV_HEADS * wl.HEAD_DIM * 2  # K and V, bf16


def cases(smoke: bool):
    if smoke:
        c = 256
        return c, [
            ("prefill", wl.single_prefill(600, chunk=c)),
            ("prefill", wl.chunked_prefills(2, 128, chunk=c)),
            ("decode", wl.decode_local(8, full_chunks=False, chunk=c)),
            ("decode", wl.decode_local(8, full_chunks=True, chunk=c)),
        ]
    c = wl.CHUNK
    return c, [
        ("prefill", wl.single_prefill(36000)),
        ("prefill", wl.chunked_prefills(8, 8192)),
        ("decode", wl.decode_local(256, full_chunks=False)),
        ("decode", wl.decode_local(256, full_chunks=True)),
    ]


def timer(args):
    if args.device == "cuda":
        repeats = args.repeats or (3 if args.smoke else 30)

        def gpu_ms(fn, slow=False):
            # The alternatives are slower and only enter as ratios: fewer repeats.
            n = max(3, repeats // 3) if slow else repeats
            return cuda_time_ms(fn, repeats=n, warmup=2)["median"]

        return gpu_ms

    def cpu_ms(fn, slow=False):  # smoke only: checks the logic, the number means nothing
        import time

        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return cpu_ms


def check(name, out, dense_batch, ref, ref_index, record):
    err = dense.relative_error(out[ref_index], ref)
    record[f"{name}_rel_err"] = err
    if not err < 2e-2:
        raise AssertionError(f"{name}: relative error {err} against float64 (limit 2e-2)")


def run_case(kind, batch, chunk, ceilings, args, time_ms):
    row = {"case": batch.name}
    builders = make_step_builders(batch, args.device, args.implementation, chunk=chunk)
    row["implementation"] = builders.implementation
    row["virtual_batches"] = builders.num_virtual_batches
    q, k_cache, v_cache = builders.chunked.inputs()
    dense_c = dense.to_dense(batch, q, k_cache, v_cache, chunk)
    ref, ref_index = dense.reference_rows(dense_c)

    out = builders.chunked.forward()
    check("chunklocal", out, dense_c, ref, ref_index, row)
    t_cl = time_ms(builders.chunked.forward)
    row["chunklocal_ms"] = t_cl
    if kind == "prefill":
        flops = wl.useful_attention_flops(batch, chunk)
        row["useful_TFLOP"] = flops / 1e12
        row["TFLOP/s"] = flops / (t_cl * 1e-3) / 1e12
        if ceilings.get("matmul_flops"):
            row["fraction_of_ceiling"] = flops / (t_cl * 1e-3) / ceilings["matmul_flops"]
    else:
        nbytes = wl.kv_tokens_read(batch, chunk) * KV_BYTES_PER_TOKEN
        row["KV_GB_read"] = nbytes / 1e9
        row["TB/s"] = nbytes / (t_cl * 1e-3) / 1e12
        if ceilings.get("copy_bytes_per_s"):
            row["fraction_of_ceiling"] = nbytes / (t_cl * 1e-3) / ceilings["copy_bytes_per_s"]

    # Full causal attention over the undivided requests: what the layer costs unchunked.
    def full_causal():
        t_full = time_ms(builders.global_.forward)
        return {"full_causal_ms": t_full, "full_causal/chunklocal": t_full / t_cl}

    def flex():
        fn = dense.flex(dense_c, compiled=args.device == "cuda")
        result = {}
        check("flex", dense_c.packed(fn()), dense_c, ref, ref_index, result)
        result["flex_ms"] = time_ms(fn, slow=True)
        result["flex/chunklocal"] = result["flex_ms"] / t_cl
        return result

    def fa3():
        # chunklocal's prefill defaults to FlashInfer's FA2 kernel (docs/gpu.md says why);
        # FA3 ("auto" on sm90) on the same virtual batches, for the floor.
        from benchmarks.library import chunked_forward

        fn = chunked_forward(batch, chunk, wl.BLOCK, (q, k_cache, v_cache),
                             prefill_backend="auto")
        result = {}
        check("chunklocal_fa3", fn(), dense_c, ref, ref_index, result)
        result["chunklocal_fa3_ms"] = time_ms(fn)
        flops = wl.useful_attention_flops(batch, chunk)
        result["fa3_TFLOP/s"] = flops / (result["chunklocal_fa3_ms"] * 1e-3) / 1e12
        if ceilings.get("matmul_flops"):
            result["fa3_fraction_of_ceiling"] = result["fa3_TFLOP/s"] * 1e12 / ceilings[
                "matmul_flops"]
        return result

    alternatives = [("full_causal", full_causal)]
    if (kind == "prefill" and args.device == "cuda"
            and builders.implementation.startswith("chunklocal")):
        alternatives.insert(0, ("fa3", fa3))
    # SDPA before Flex: Flex compiles (slow), so a time limit hits it first.
    if not args.skip_sdpa:
        alternatives.append(("sdpa", lambda: run_sdpa(dense_c, ref, ref_index, t_cl, time_ms)))
    if not args.skip_flex:
        alternatives.append(("flex", flex))
    for name, fn in alternatives:
        # One alternative failing (compile error, no kernel) must not lose the others.
        try:
            row.update(fn())
        except Exception as exc:  # noqa: BLE001
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            print(f"[{batch.name}] {name} failed: {row[f'{name}_error']}", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return row


def run_sdpa(dense_c, ref, ref_index, t_cl, time_ms):
    result = {}
    try:
        mask = dense_c.dense_mask()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"sdpa": "the dense mask does not fit in memory"}
    result["sdpa_mask_GB"] = mask.numel() / 1e9
    failures = []
    for expand in (False, True):
        how = "K/V repeated to Hq heads" if expand else "enable_gqa"
        try:
            fn = dense.sdpa(dense_c, mask, expand_kv=expand)
            check("sdpa", dense_c.packed(fn()), dense_c, ref, ref_index, result)
            result["sdpa_ms"] = time_ms(fn, slow=True)
            result["sdpa/chunklocal"] = result["sdpa_ms"] / t_cl
            result["sdpa"] = how
            break
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            kind = "out of memory" if isinstance(exc, torch.OutOfMemoryError) else "error"
            failures.append(f"{how}: {kind}: {str(exc).splitlines()[0][:120]}")
    if failures:
        result["sdpa_failures"] = failures
    if "sdpa_ms" not in result:
        result["sdpa"] = "does not fit / no kernel: " + "; ".join(failures)
    return result


def main(argv=None) -> int:
    parser = common.device_parser(
        __doc__.splitlines()[0], "cpu only with --smoke (torch reference stands in for FlashInfer)")
    parser.add_argument("--implementation", choices=("auto", "chunklocal", "direct", "torch"),
                        default="auto", help="what 'chunklocal' means (see benchmarks/steps.py)")
    parser.add_argument("--skip-flex", action="store_true")
    parser.add_argument("--skip-sdpa", action="store_true")
    args = common.parse_device_args(parser, argv)
    if args.device == "cpu":
        args.implementation = "torch"
    torch.manual_seed(0)
    errors: list = []
    ceilings = common.measure_ceilings(args.smoke) if args.device == "cuda" else {}
    chunk, todo = cases(args.smoke)
    time_ms = timer(args)
    rows = []
    name = "kernel_floor_smoke" if args.smoke else "kernel_floor"

    def save():  # after every case, so a timeout keeps what was measured
        return write_json(name, {"ceilings": ceilings, "rows": rows, "errors": errors,
                                 "chunk_size": chunk, "args": vars(args)}, args.out)

    for kind, batch in todo:
        row = guarded(batch.name, lambda k=kind, b=batch: run_case(k, b, chunk, ceilings, args,
                                                                    time_ms), errors)
        if row:
            rows.append(row)
            print(format_table([row]), flush=True)
        save()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    columns = ["case", "chunklocal_ms", "TFLOP/s", "TB/s", "fraction_of_ceiling",
               "fa3_fraction_of_ceiling", "full_causal/chunklocal", "flex/chunklocal",
               "sdpa/chunklocal", "virtual_batches"]
    print(format_table(rows, columns))
    print(f"wrote {save()}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
