"""Per-token FP8 quantization at prefill sizes: the kernel's launch choices, side by side.

A prefill step of Scout FP8 quantizes four times a layer (8,192 tokens a step): the shared
expert's input (``quantize_rows``, K = 5120), the routed rows gathered and scaled by their
router scores (``quantize_rows`` with ``rows``), and each expert's ``silu(gate) * up``
(``silu_mul_quantize``, K = 8192 from [gate | up] of 16384).  On an H100 a 12-layer step
spent 5.6 ms in those 48 launches (BENCHMARKS.md, thirty-second session): about 65% of the
copy rate for the bytes they must move.  This times ``quant_triton.launch_config``'s choice
beside the alternatives (one pass at other warp counts; two passes at other blocks), each
captured in a CUDA graph of ``REPLAYS`` launches, every output checked bit for bit against
the default's.  Floor: bytes read and written at the copy rate measured in the same run.

    python -m benchmarks.quant_rows --out OUT [--rows 256 2048 8192] [--smoke]

``--smoke`` runs tiny shapes (Triton's interpreter on the CPU: ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from benchmarks.common import (
    base_parser,
    cuda_time_ms,
    format_table,
    measure_copy_bytes_per_s,
    write_json,
)
from chunklocal.models import quant_triton

REPLAYS = 10
ONE_PASS_WARPS = (4, 8, 16, 32)
TWO_PASS = ((1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8))
SMOKE_TWO_PASS = ((32, 4), (64, 4))  # --smoke's rows are 64-128 wide


def shapes(hidden: int, inter: int) -> dict:
    """Name -> (input width, output width, which call quantizes it)."""
    return {"input": (hidden, hidden, "rows"), "gather": (hidden, hidden, "gather"),
            "silu": (2 * inter, inter, "silu")}


def configs(k_dim: int, rows: int, silu: bool, two_pass=TWO_PASS
            ) -> list[tuple[bool, int, int]]:
    """The default first, then every one-pass warp count (where a block holds the row)
    and the two-pass blocks narrower than the row."""
    block = quant_triton.triton.next_power_of_2(k_dim)
    choices = [quant_triton.launch_config(k_dim, rows, silu)]
    choices += [(True, block, w) for w in ONE_PASS_WARPS]
    choices += [(False, b, w) for b, w in two_pass if b < k_dim]
    return list(dict.fromkeys(choices))


def label(config: tuple[bool, int, int]) -> str:
    one_pass, block, warps = config
    return f"{'one' if one_pass else 'two'}_b{block}_w{warps}"


def measure(rows: int, hidden: int, inter: int, copy_rate, two_pass, errors: list,
            gen) -> list[dict]:
    """Each shape at ``rows`` rows: every launch choice's bits against the default's (a
    mismatch goes to ``errors``) and, on CUDA, its time in a graph of ``REPLAYS``."""
    cuda = copy_rate is not None
    device = "cuda" if cuda else "cpu"
    out = []
    for name, (width, k_dim, form) in shapes(hidden, inter).items():
        x = torch.randn(rows, width, generator=gen, device=device).to(torch.bfloat16)
        perm = torch.randperm(rows, generator=gen, device=device)
        score = torch.rand(rows, generator=gen, device=device).to(torch.bfloat16)

        def call(config, x=x, perm=perm, score=score, form=form):
            if form == "silu":
                return quant_triton.silu_mul_quantize(x, config=config)
            if form == "gather":
                return quant_triton.quantize_rows(x, None, perm, score, config=config)
            return quant_triton.quantize_rows(x, config=config)

        moved = rows * (width * 2 + k_dim + 4) + (rows * 10 if form == "gather" else 0)
        default = quant_triton.launch_config(k_dim, rows, form == "silu")
        row = {"shape": name, "rows": rows, "k": k_dim, "bytes": moved,
               "default": label(default)}
        if cuda:
            row["floor_us"] = moved / copy_rate * 1e6
        want = call(None)
        for config in configs(k_dim, rows, form == "silu", two_pass):
            key = label(config)
            got = call(config)
            if not (torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
                    and torch.equal(got[1], want[1])):
                errors.append(f"{name} {rows} rows {key}: not the default's bits")
                continue
            if not cuda:
                row[f"{key}_us"] = None
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(REPLAYS):
                    call(config)
            us = cuda_time_ms(graph.replay, repeats=20)["median"] * 1e3 / REPLAYS
            row[f"{key}_us"] = us
            row[f"{key}_share"] = row["floor_us"] / us
        out.append(row)
        print(format_table([{k: v for k, v in row.items() if not k.endswith("_share")}]),
              flush=True)
    return out


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8192],
                        help="tokens a step, one measurement each (decode batches to prefill "
                        "chunks: where the default's choice changes, TWO_PASS_ROWS)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    hidden, inter = (5120, 8192) if not args.smoke else (96, 64)
    copy_rate = measure_copy_bytes_per_s("cuda") if cuda else None
    gen = torch.Generator(device="cuda" if cuda else "cpu").manual_seed(0)
    out_rows: list[dict] = []
    errors: list[str] = []
    for rows in ([3] if args.smoke else args.rows):
        out_rows += measure(rows, hidden, inter, copy_rate,
                            SMOKE_TWO_PASS if args.smoke else TWO_PASS, errors, gen)
    payload = {"benchmark": "quant_rows", "copy_bytes_per_s": copy_rate, "rows": out_rows,
               "errors": errors}
    path = write_json("quant_rows_smoke" if args.smoke else "quant_rows", payload,
                      Path(args.out) if args.out else None)
    print(f"wrote {path}" + (f"; errors: {errors}" if errors else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
