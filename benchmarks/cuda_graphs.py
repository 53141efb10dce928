"""Q4: one decode step of a chunked layer and a global layer, eager vs CUDA-graph replay (GPU).

One merged KV group (both layer kinds on one ``FlashInferBackend``), 40/8 heads,
dim 128, bf16, page 16, c = 8192, contexts spread over 1k..32k tokens.  Per
batch size B (1, 8, 64, 256) the step, metadata update included, is timed as:

* ``eager``: ``build()`` on the host (virtual batches, paged KV, two plans) + the
  two layers' ``forward()``;
* ``graph, host metadata``: ``build(..., graph_batch_size=B)`` (host write, three
  non-blocking copies) + replay of a graph holding the two forwards, captured over
  ``capture_step(B, 1)`` as the engine does.

``--max-model-len`` plans the graphs for a longer limit than the contexts, as a server
with a long ``--max-model-len`` does:

    python -m benchmarks.cuda_graphs --batch-sizes 1 8 --min-context 1024 --max-context 1024
    python -m benchmarks.cuda_graphs --batch-sizes 1 8 --min-context 1024 --max-context 1024 \
        --max-model-len 131072

(A device-side metadata path, captured in the graph, was measured before and removed:
the engine never used it.)  Graph outputs are checked against eager before timing.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from benchmarks import workloads as wl
from benchmarks.common import base_parser, cuda_time_ms, format_table, guarded, write_json
from benchmarks.steps import random_inputs


def decode_batch(b: int, lo: int, hi: int, chunk: int) -> wl.Batch:
    seq = lo + ((hi - lo) * (np.arange(b) + 1)) // b
    return wl.make_batch(f"{b} decodes", np.ones(b, np.int64), seq, chunk=chunk)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def run_batch(b: int, args) -> dict:
    from chunklocal.backends.base import EngineLimits
    from chunklocal.backends.flashinfer import FlashInferBackend
    from chunklocal.kv_spec import ChunkedLocalAttentionSpec, FullAttentionSpec, Kind, merge

    chunk, block = args.chunk, wl.BLOCK
    batch = decode_batch(b, args.min_context, args.max_context, chunk)
    geometry = (block, wl.NUM_KV_HEADS, wl.HEAD_DIM, torch.bfloat16)
    spec = merge([ChunkedLocalAttentionSpec(*geometry, attention_chunk_size=chunk),
                  FullAttentionSpec(*geometry)])
    # The graph plans split-KV for the longest keys a slot can read (docs/gpu.md): a
    # longer max_model_len than the contexts (a server's --max-model-len) splits coarser.
    model_len = -(-max(args.max_context, args.max_model_len or 0) // block) * block
    limits = EngineLimits(b, b, model_len, block)
    backend = FlashInferBackend(spec, limits, wl.NUM_Q_HEADS, wl.NUM_KV_HEADS, wl.HEAD_DIM,
                                torch.bfloat16, "cuda", cuda_graphs=True,
                                graph_batch_sizes=(b,), scratch_page=0)
    q, k_cache, v_cache = random_inputs(batch, "cuda", block)
    scale = wl.HEAD_DIM ** -0.5
    qsl, seq, table = batch.query_start_loc, batch.seq_lens, batch.block_table

    def layers(md):
        return (backend.forward(md, q, k_cache, v_cache, scale, kind=Kind.CHUNKED),
                backend.forward(md, q, k_cache, v_cache, scale, kind=Kind.GLOBAL))

    def eager_step():
        return layers(backend.build(qsl, seq, table))

    eager_out = eager_step()
    planned = backend.build(qsl, seq, table)

    # Graph with host metadata: the forwards only.
    graph_md = backend.capture_step(b, 1)
    host_graph, host_out = capture(lambda: layers(graph_md))

    def host_graph_step():
        backend.build(qsl, seq, table, graph_batch_size=b)
        host_graph.replay()

    row = {"batch": b, "max_context": args.max_context, "max_model_len": model_len}
    host_graph_step()
    torch.cuda.synchronize()
    row["host_graph_rel_err"] = max(rel(o, e) for o, e in zip(host_out, eager_out, strict=True))
    if not row["host_graph_rel_err"] < 1e-2:
        raise AssertionError(f"B={b}: graph output differs from eager: {row}")

    repeats = args.repeats or (5 if args.smoke else 50)
    row["eager_ms"] = cuda_time_ms(eager_step, repeats)["median"]
    row["eager_forward_only_ms"] = cuda_time_ms(lambda: layers(planned), repeats)["median"]
    row["graph_host_md_ms"] = cuda_time_ms(host_graph_step, repeats)["median"]
    row["speedup_host_md"] = row["eager_ms"] / row["graph_host_md_ms"]
    return row


def capture(fn):
    """Warm up on a side stream, then capture ``fn`` into a CUDA graph; return (graph, outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--min-context", type=int, default=1024)
    parser.add_argument("--max-context", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=wl.CHUNK)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engine limit the graphs plan for (default: --max-context)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch_sizes, args.max_context, args.chunk = [1, 4], 3000, 1024
    if not torch.cuda.is_available():
        print("cuda_graphs: needs CUDA and flashinfer; nothing to do on this machine")
        return 0
    errors: list = []
    rows = []
    name = "cuda_graphs_smoke" if args.smoke else "cuda_graphs"

    def save():  # after every batch size, so a timeout keeps what was measured
        return write_json(name, {"rows": rows, "errors": errors, "args": vars(args)}, args.out)

    for b in args.batch_sizes:
        row = guarded(f"B={b}", lambda b=b: run_batch(b, args), errors)
        if row:
            rows.append(row)
            print(format_table([row]), flush=True)
        save()
        torch.cuda.empty_cache()
    print(format_table(rows, ["batch", "eager_ms", "eager_forward_only_ms", "graph_host_md_ms",
                              "speedup_host_md", "host_graph_rel_err"]))
    print(f"wrote {save()}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
