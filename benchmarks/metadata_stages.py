"""Where the host metadata time goes (Q3 follow-up): stage by stage, on the CPU.

Times, for the 256-decode case (contexts 1k..128k), each stage of an eager
step's host build: ``write_step`` as the backends call it (which takes the
fast paths ``write_decode_chunked`` for chunked layers and
``write_whole_requests`` for global ones), the general ``write_host`` path
those fast paths replace, the checks and splits around them, and the two
numpy primitives the general path is made of: the flat page index and the
gather of the page ids through it.  Every path is first checked to fill the same arrays
as the general one, so a faster row is never a wrong one.
"""

from __future__ import annotations

import sys

import numpy as np

from benchmarks import workloads as wl
from benchmarks.common import base_parser, cpu_time_us, format_table, write_json
from benchmarks.library import limits_for, specs

FIELDS = ("paged_kv_indptr", "paged_kv_last_page_len", "paged_kv_indices")


def snapshot(step) -> dict:
    """The filled arrays of a HostStep, copied (the next write reuses the mirrors)."""
    return {f: getattr(step, f).numpy().copy() for f in FIELDS}


def check_same(name: str, got: dict, want: dict) -> None:
    for field in FIELDS:
        if not np.array_equal(got[field], want[field]):
            raise AssertionError(f"{name}: {field} differs from the general path")


def flat_page_index(kv_lens, first_page, rows, width: int, block: int) -> np.ndarray:
    """Flat positions in the block table of every page the slots read (row-major)."""
    pages = (kv_lens.astype(np.int64) + block - 1) // block
    starts = np.cumsum(pages) - pages
    return np.repeat(rows * width + first_page - starts, pages) + np.arange(int(pages.sum()))


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    from chunklocal.backends.flashinfer.buffers import MetadataBuffers, write_step
    from chunklocal.backends.flashinfer.graph_layout import graph_slots
    from chunklocal.bounds.sizing import step_capacity
    from chunklocal.kv_spec import Kind
    from chunklocal.virtual_batches import make_virtual_batches, validate_batch

    batch = (wl.decode_ragged_contexts(16, 1024, 32768) if args.smoke
             else wl.decode_ragged_contexts(256))
    repeats = args.repeats or (5 if args.smoke else 200)
    qsl, seq, table = batch.query_start_loc, batch.seq_lens, batch.block_table
    query_lens, width = np.diff(qsl), table.shape[1]
    limits = limits_for(batch, wl.BLOCK)
    chunked_spec, global_spec = specs(wl.CHUNK, wl.BLOCK)
    cbuf = MetadataBuffers(step_capacity(chunked_spec, limits, kind=Kind.CHUNKED), wl.BLOCK)
    gbuf = MetadataBuffers(step_capacity(global_spec, limits, kind=Kind.GLOBAL), wl.BLOCK)
    rows = np.arange(batch.num_reqs)
    no_offset = np.zeros(batch.num_reqs, np.int64)
    slots = graph_slots(seq.astype(np.int64), 1, wl.CHUNK, wl.BLOCK, False)

    def chunked_general():
        return cbuf.write_host(query_lens, *slots, table)

    def global_general():
        return gbuf.write_host(query_lens, seq, no_offset, rows, table)

    paths = {
        "chunked": (chunked_general, {
            "write_step": lambda: write_step(cbuf, qsl, seq, table, query_lens, wl.CHUNK),
            "write_decode_chunked": lambda: cbuf.write_decode_chunked(seq, table, wl.CHUNK)}),
        "global": (global_general, {
            "write_step": lambda: write_step(gbuf, qsl, seq, table, query_lens, None),
            "write_whole_requests": lambda: gbuf.write_whole_requests(query_lens, seq, table)}),
    }
    pages = {}
    for kind, (general, fast) in paths.items():
        want = snapshot(general())
        pages[kind] = want["paged_kv_indices"].size
        for name, fn in fast.items():
            check_same(f"{kind} {name}", snapshot(fn()), want)

    flat_c = flat_page_index(*slots, width, wl.BLOCK)
    flat_g = flat_page_index(seq, no_offset, rows, width, wl.BLOCK)
    out_c, out_g = np.empty(flat_c.size, np.int32), np.empty(flat_g.size, np.int32)
    stages = [
        ("chunked", "write_step (total; takes write_decode_chunked)",
         paths["chunked"][1]["write_step"]),
        ("chunked", "  write_decode_chunked", paths["chunked"][1]["write_decode_chunked"]),
        ("chunked", "  general path: graph_slots + write_host", lambda: (
            graph_slots(seq.astype(np.int64), 1, wl.CHUNK, wl.BLOCK, False),
            chunked_general())),
        ("chunked", f"  primitive: flat page index ({flat_c.size} pages)",
         lambda: flat_page_index(*slots, width, wl.BLOCK)),
        ("chunked", f"  primitive: np.take of {flat_c.size} page ids",
         lambda: np.take(table.reshape(-1), flat_c, out=out_c)),
        ("chunked", "make_virtual_batches (prefill / mixed steps only)",
         lambda: make_virtual_batches(qsl, seq, table, wl.CHUNK, wl.BLOCK)),
        ("chunked", "validate_batch (in FlashInferBackend.build)",
         lambda: validate_batch(qsl, seq, table, wl.BLOCK)),
        ("global", "write_step (total; takes write_whole_requests)",
         paths["global"][1]["write_step"]),
        ("global", "  write_whole_requests", paths["global"][1]["write_whole_requests"]),
        ("global", "  general path: write_host", global_general),
        ("global", f"  primitive: flat page index ({flat_g.size} pages)",
         lambda: flat_page_index(seq, no_offset, rows, width, wl.BLOCK)),
        ("global", f"  primitive: np.take of {flat_g.size} page ids",
         lambda: np.take(table.reshape(-1), flat_g, out=out_g)),
    ]
    out = []
    for kind, stage, fn in stages:
        t = cpu_time_us(fn, repeats, warmup=3)
        out.append({"layers": kind, "stage": stage, "median_us": t["median"],
                    "p10_us": t["p10"], "p90_us": t["p90"]})
    print(f"{batch.name}: {pages['chunked']} chunked pages, {pages['global']} global pages, "
          f"block table {table.shape}")
    print(format_table(out))
    name = "metadata_stages_smoke" if args.smoke else "metadata_stages"
    path = write_json(name, {"case": batch.name, "rows": out, "args": vars(args)}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
