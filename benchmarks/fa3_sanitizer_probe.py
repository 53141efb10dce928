"""Small prefill probe meant to run *under* compute-sanitizer, with controls (issue 14).

Each item runs ``--repeats`` times and reports, per (row, head) against float32,
rows off by > 5 %, the worst error and how many repeats differ bit for bit from
the first.  The controls separate "the tool breaks asynchronous Hopper code" from
"the tool's timing exposes a race in FlashInfer's paged FA3 kernel":

* ``paged_fa2`` / ``paged_fa3``: FlashInferBackend, prefill_backend "fa2" / "auto",
  the issue's small case (2 requests, c = 256, 500 query rows behind prefixes);
* ``ragged_fa3``: FlashInfer's ragged FA3 kernel on a fresh 500-token prompt, split
  at c = 256: K/V arrive by TMA (PipelineTmaAsync), not by cp.async as in the paged
  kernel, and the same warp-specialised consumer code (wgmma, named barriers);
* ``cublas_bf16``: a bf16 1024^3 torch.matmul (cuBLAS's sm90 kernels are TMA +
  wgmma warp-specialised too) against a float32 matmul with TF32 off.

``--reporter`` adds the reporter's prompt (36000 tokens, c = 8192) for FA2 and FA3
(slow under a sanitizer: memcheck only).  Run it as, e.g.::

    compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 0 \\
        python -m benchmarks.fa3_sanitizer_probe --out $OUT/probe_racecheck.json
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchmarks import prefill_common as pc
from benchmarks import workloads as wl

SCALE = wl.HEAD_DIM ** -0.5


def small_batch():
    """The issue's small case: 2 requests, 250 query rows each, behind prefixes 103 and 290."""
    b = wl.make_batch("small", [250, 250], [353, 540], chunk=256)
    return pc.StressBatch(b.query_start_loc, b.seq_lens, b.block_table, 256)


def repeat(fn, ref, n: int) -> dict:
    import torch

    first, distinct, total = None, 0, None
    for _ in range(n):
        out = fn()
        total = pc.merge_summary(total, pc.summarize(pc.row_errors(out, ref)))
        if first is None:
            first = out.clone()
        elif not torch.equal(out, first):
            distinct += 1
    return {**total, "repeats": n, "repeats_differing_bitwise_from_first": distinct}


def paged_items(batch, kernels, args):
    import torch

    from benchmarks.prefill_stress import KERNELS

    k, v = pc.random_pool(int(batch.block_table.max()) + 1, "cuda", args.seed)
    q = pc.random_queries(batch.num_tokens, "cuda", args.seed + 1)
    ref = pc.reference(q, k.float(), v.float(), batch, SCALE)
    limits = pc.engine_limits(4, batch.num_tokens, int(batch.seq_lens.max()))
    items = {}
    for kernel in kernels:
        backend = pc.make_backend(batch.chunk, KERNELS[kernel], limits, "cuda")
        md = backend.build(batch.query_start_loc, batch.seq_lens, batch.block_table)

        def fn(backend=backend, md=md):
            out = torch.full_like(q, float("nan"))
            backend.forward(md, q, k, v, SCALE, out=out)
            return out

        items[kernel] = repeat(fn, ref, args.repeats)
    return items


def ragged_fa3(args):
    import flashinfer
    import torch

    from benchmarks.prefill_ragged import ragged_split, step_slots

    batch = pc.reporter_batch(500, 256, seed=args.seed)
    k, v = pc.random_pool(int(batch.block_table.max()) + 1, "cuda", args.seed)
    q = pc.random_queries(batch.num_tokens, "cuda", args.seed + 1)
    ref = pc.reference(q, k.float(), v.float(), batch, SCALE)
    slots = torch.from_numpy(step_slots(batch)).cuda()
    k_new, v_new = (x.flatten(0, 1).index_select(0, slots) for x in (k, v))
    split = ragged_split(batch)
    assert split.paged_rows.size == 0, "a fresh prompt has no earlier keys"
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
    qo = torch.from_numpy(split.qo_indptr)
    wrapper.plan(qo, qo, wl.NUM_Q_HEADS, wl.NUM_KV_HEADS, wl.HEAD_DIM, causal=True,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=SCALE)

    def fn():
        out = torch.full_like(q, float("nan"))
        wrapper.run(q, k_new, v_new, out=out)
        return out

    return repeat(fn, ref, args.repeats)


def cublas_bf16(args):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    a, b = (torch.randn(1024, 1024, device="cuda", generator=gen) for _ in range(2))
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = a @ b  # float32, no TF32: SIMT kernels, no wgmma
    torch.backends.cuda.matmul.allow_tf32 = old
    a16, b16 = a.bfloat16(), b.bfloat16()
    ref16 = a16.float() @ b16.float()  # same rounded inputs: isolates the kernel
    del ref
    return repeat(lambda: (a16 @ b16)[:, None, :], ref16[:, None, :], args.repeats)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="JSON file or directory")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reporter", action="store_true", help="add the 36000-token prompt")
    p.add_argument("--skip-controls", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("fa3_sanitizer_probe needs CUDA", file=sys.stderr)
        return 2
    payload = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "sanitizer_env": {k: v for k, v in os.environ.items()
                                 if k.startswith(("CHUNKLOCAL_", "COMPUTE_SANITIZER"))},
               "items": {}, "errors": []}
    todo = [("small", lambda: paged_items(small_batch(), ("fa2", "fa3"), args))]
    if not args.skip_controls:
        todo += [("ragged_fa3", lambda: ragged_fa3(args)),
                 ("cublas_bf16", lambda: cublas_bf16(args))]
    if args.reporter:
        todo.append(("reporter", lambda: paged_items(pc.reporter_batch(seed=args.seed),
                                                     ("fa2", "fa3"), args)))
    for name, fn in todo:
        try:
            payload["items"][name] = fn()
        except Exception as exc:  # noqa: BLE001 - one failing item must not lose the others
            payload["errors"].append({"item": name, "error": f"{type(exc).__name__}: {exc}"})
        print(f"{name}: {payload['items'].get(name)}", flush=True)
        pc.save(payload, args.out, "fa3_sanitizer_probe")
    return 1 if payload["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
