"""Where the host metadata time goes (Q3 follow-up): stage by stage, on the CPU.

Times each stage of ``write_step`` for the 256-decode case (contexts 1k..128k)
separately, and next to it a *proposal* (not library code): a decode-only
chunked build that gathers each request's last-chunk pages straight from the
caller's block table with one flat ``np.take`` (no [M, c / block] local table,
one gather of the pages actually read instead of two).  The proposal
is checked to produce the same arrays as the library before it is timed.  For
the global layers the proposal is one boolean-mask gather over the table (rows
come out in row-major order, which is the kv_indices order).
"""

from __future__ import annotations

import sys

import numpy as np

from benchmarks import workloads as wl
from benchmarks.common import base_parser, cpu_time_us, format_table, write_json
from benchmarks.library import limits_for, specs


def decode_chunked_flat(seq_lens, block_table, chunk: int, block: int, out: dict) -> int:
    """Proposal: paged-KV arrays of a decode-only step's chunked layers (one slot/request)."""
    s = seq_lens.astype(np.int64)
    n, width = s.shape[0], block_table.shape[1]
    start = (s - 1) // chunk * chunk
    keys = s - start
    pages = (keys + block - 1) // block
    indptr = out["paged_kv_indptr"]
    indptr[0] = 0
    np.cumsum(pages, out=indptr[1:n + 1])
    total = int(indptr[n])
    out["paged_kv_last_page_len"][:n] = keys - (pages - 1) * block
    base = np.arange(n, dtype=np.int64) * width + start // block - indptr[:n]
    flat = np.repeat(base, pages) + np.arange(total)
    np.take(block_table.reshape(-1), flat, out=out["paged_kv_indices"][:total])
    return total


def global_masked(seq_lens, block_table, block: int, out: dict) -> int:
    """Proposal: paged-KV indices of whole requests as one boolean-mask gather (row-major)."""
    s = seq_lens.astype(np.int64)
    n = s.shape[0]
    pages = (s + block - 1) // block
    indptr = out["paged_kv_indptr"]
    indptr[0] = 0
    np.cumsum(pages, out=indptr[1:n + 1])
    total = int(indptr[n])
    out["paged_kv_last_page_len"][:n] = s - (pages - 1) * block
    keep = np.arange(block_table.shape[1])[None, :] < pages[:, None]
    out["paged_kv_indices"][:total] = block_table[keep]
    return total


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    from chunklocal import metadata as md
    from chunklocal.metadata import MetadataBuffers, step_capacity, write_step
    from chunklocal.virtual_batches import make_virtual_batches, validate_batch

    batch = (wl.decode_ragged_contexts(16, 1024, 32768) if args.smoke
             else wl.decode_ragged_contexts(256))
    repeats = args.repeats or (5 if args.smoke else 200)
    qsl, seq, table = batch.query_start_loc, batch.seq_lens, batch.block_table
    query_lens = np.diff(qsl)
    limits = limits_for(batch, wl.BLOCK)
    chunked_spec, global_spec = specs(wl.CHUNK, wl.BLOCK)
    cbuf = MetadataBuffers(step_capacity(chunked_spec, limits, chunked=True), wl.BLOCK)
    gbuf = MetadataBuffers(step_capacity(global_spec, limits, chunked=False), wl.BLOCK)
    vb = make_virtual_batches(qsl, seq, table, wl.CHUNK, wl.BLOCK)
    graph_slots = getattr(md, "graph_slots", None)  # the pure-decode path's slot layout
    rows = np.arange(batch.num_reqs)

    # The proposal must equal the library before its time means anything.
    ref = write_step(cbuf, qsl, seq, table, query_lens, wl.CHUNK)
    mine = {k: np.zeros_like(v.numpy()) for k, v in cbuf.host[0].items()}
    total = decode_chunked_flat(seq, table, wl.CHUNK, wl.BLOCK, mine)
    n = vb.num_batches
    assert total == ref.num_pages
    assert np.array_equal(mine["paged_kv_indices"][:total], ref.paged_kv_indices.numpy())
    assert np.array_equal(mine["paged_kv_indptr"][:n + 1], ref.paged_kv_indptr.numpy())
    assert np.array_equal(mine["paged_kv_last_page_len"][:n],
                          ref.paged_kv_last_page_len.numpy())

    gref = write_step(gbuf, qsl, seq, table, query_lens, None)
    gmine = {k: np.zeros_like(v.numpy()) for k, v in gbuf.host[0].items()}
    gtotal = global_masked(seq, table, wl.BLOCK, gmine)
    assert gtotal == gref.num_pages
    assert np.array_equal(gmine["paged_kv_indices"][:gtotal], gref.paged_kv_indices.numpy())
    assert np.array_equal(gmine["paged_kv_indptr"][:batch.num_reqs + 1],
                          gref.paged_kv_indptr.numpy())

    # The flat page index a host build gathers through, and the gather itself: the
    # part of write_host that grows with the pages read.
    def flat_index(kv, first, slot_rows):
        pages = (kv.astype(np.int64) + wl.BLOCK - 1) // wl.BLOCK
        starts = np.cumsum(pages) - pages
        base = (slot_rows * table.shape[1] + first - starts).astype(np.int32)
        flat = np.repeat(base, pages)
        flat += np.arange(int(pages.sum()), dtype=np.int32)
        return flat

    stages = [("chunked", "write_step (total)",
               lambda: write_step(cbuf, qsl, seq, table, query_lens, wl.CHUNK))]
    if graph_slots is not None:
        kv, first, slot_rows = graph_slots(seq.astype(np.int64), 1, wl.CHUNK, wl.BLOCK, False)
        flat_c = flat_index(kv, first, slot_rows)
        out_c = np.empty(flat_c.size, np.int32)
        stages += [
            ("chunked", "  graph_slots (one slot per decode)",
             lambda: graph_slots(seq.astype(np.int64), 1, wl.CHUNK, wl.BLOCK, False)),
            ("chunked", "  MetadataBuffers.write_host (request's own table)",
             lambda: cbuf.write_host(query_lens, kv, first, slot_rows, table)),
            ("chunked", f"    flat page index (np.repeat + arange, {flat_c.size} pages)",
             lambda: flat_index(kv, first, slot_rows)),
            ("chunked", f"    np.take of {flat_c.size} page ids",
             lambda: np.take(table.reshape(-1), flat_c, out=out_c)),
        ]
    flat_g = flat_index(seq.astype(np.int64), np.zeros(batch.num_reqs, np.int64), rows)
    out_g = np.empty(flat_g.size, np.int32)
    stages += [
        ("chunked", "make_virtual_batches (prefill / mixed steps only)",
         lambda: make_virtual_batches(qsl, seq, table, wl.CHUNK, wl.BLOCK)),
        ("chunked", "validate_batch", lambda: validate_batch(qsl, seq, table, wl.BLOCK)),
        ("chunked", "proposal: decode_chunked_flat",
         lambda: decode_chunked_flat(seq, table, wl.CHUNK, wl.BLOCK, mine)),
        ("global", "write_step (total)",
         lambda: write_step(gbuf, qsl, seq, table, query_lens, None)),
        ("global", "  MetadataBuffers.write_host",
         lambda: gbuf.write_host(query_lens, seq, np.zeros(batch.num_reqs, np.int64), rows,
                                 table)),
        ("global", f"    flat page index (np.repeat + arange, {flat_g.size} pages)",
         lambda: flat_index(seq.astype(np.int64), np.zeros(batch.num_reqs, np.int64), rows)),
        ("global", f"    np.take of {flat_g.size} page ids",
         lambda: np.take(table.reshape(-1), flat_g, out=out_g)),
        ("global", "proposal: global_masked",
         lambda: global_masked(seq, table, wl.BLOCK, gmine)),
    ]
    out = []
    for kind, stage, fn in stages:
        t = cpu_time_us(fn, repeats, warmup=3)
        out.append({"layers": kind, "stage": stage, "median_us": t["median"],
                    "p10_us": t["p10"], "p90_us": t["p90"]})
    print(f"{batch.name}: {vb.num_batches} virtual batches, {ref.num_pages} chunked pages, "
          f"block table {table.shape}")
    print(format_table(out))
    name = "metadata_stages_smoke" if args.smoke else "metadata_stages"
    path = write_json(name, {"case": batch.name, "rows": out, "args": vars(args)}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
