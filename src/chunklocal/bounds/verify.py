"""`chunklocal verify-bounds`: brute-force maxima against the closed forms and the published bound.

The brute force never calls the closed forms' reasoning.  For one (c, L, bs) it
enumerates every request (q, s) with 1 <= q <= s <= L, cuts it at chunk
boundaries (batches = chunks touched, pages = sum of cdiv(keys, bs)) and keeps
the best s for each q: a per-request value table.  Requests interact only
through N and T, so an exact max-plus knapsack over (requests, tokens) combines
the tables; one DP answers every (N, T) of the grid at once.  Verify steps
(q = k + 1 for every request) are enumerated over every start position.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from chunklocal._validate import positive_int
from chunklocal.bounds.closed_forms import (
    _global_pages_formula,
    _local_pages_formula,
    _virtual_batches_formula,
    max_uniform_verify_batches,
    max_verify_batches,
    max_verify_batches_of_length,
)

_NEG = -(1 << 40)
_FIXED_LENS = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 256, 400)
_METRICS = ("batches", "local_pages", "global_pages")


def request_tables(chunk: int, model_len: int, block_size: int, max_q: int):
    """Best value per query length q = 1..max_q (index 0 unused) over all s <= L."""
    q = np.arange(1, max_q + 1)[:, None]
    seq = np.arange(1, model_len + 1)[None, :]
    first_chunk = (seq - q) // chunk
    last_chunk = (seq - 1) // chunk
    batches = last_chunk - first_chunk + 1
    # Every piece but the last sees its whole chunk; the last sees s - its start.
    pages = (batches - 1) * (chunk // block_size) - (-(seq - last_chunk * chunk) // block_size)
    whole = -(-seq // block_size) + 0 * q
    feasible = seq >= q
    tables = {}
    for name, value in zip(_METRICS, (batches, pages, whole), strict=True):
        best = np.where(feasible, value, _NEG).max(axis=1)
        tables[name] = np.concatenate([[_NEG], best])
    return tables


def combine(table: np.ndarray, max_n: int, max_t: int) -> np.ndarray:
    """best[n, t]: max total over at most n requests (q >= 1 each) with at most t tokens."""
    max_q = min(table.shape[0] - 1, max_t)
    reversed_values = table[max_q:0:-1]
    best = np.zeros((max_n + 1, max_t + 1), dtype=np.int64)
    exactly = np.zeros(max_t + 1, dtype=np.int64)  # j requests, <= t tokens
    padded = np.full(max_t + 1 + max_q, _NEG, dtype=np.int64)
    for j in range(1, max_n + 1):
        padded[max_q:] = exactly
        windows = sliding_window_view(padded, max_q)[: max_t + 1]
        exactly = np.maximum((windows + reversed_values).max(axis=1), _NEG)
        best[j] = np.maximum(best[j - 1], exactly)
    return best


def model_lens(chunk: int, extra=()) -> list[int]:
    relative = (chunk - 1, chunk, chunk + 1, 2 * chunk - 1, 2 * chunk, 2 * chunk + 1,
                3 * chunk + 1, 4 * chunk - 1)
    return sorted({v for v in (*_FIXED_LENS, *relative, *extra) if v >= 1})


def _verify_brute(q: int, chunk: int, model_len: int):
    """Per request: most pieces, and most pieces of each length 1..q, over all starts."""
    start = np.arange(0, model_len - q + 1)
    first = np.minimum(chunk - start % chunk, q)
    full, rest = np.divmod(q - first, chunk)
    pieces = 1 + full + (rest > 0)
    lengths = np.arange(1, q + 1)[:, None]
    of_length = ((first == lengths) + full * (lengths == chunk)
                 + ((rest == lengths) & (rest > 0)))
    return int(pieces.max()), of_length.max(axis=1)


def check_group(task):
    """Compare every (N, T, bs) of one (c, L) to brute force; return counts."""
    chunk, model_len, max_n, max_t, max_k = task
    n_grid, t_grid = np.meshgrid(np.arange(1, max_n + 1), np.arange(1, max_t + 1), indexing="ij")
    max_q = min(model_len, max_t)
    published = np.minimum(2 * n_grid + (-(-t_grid // chunk)), t_grid)
    stats: dict[str, Any] = {"configs": 0, "verify_checks": 0, "verify_violations": 0,
                             "examples": []}
    for name in _METRICS:
        stats.update({f"{name}_violations": 0, f"{name}_published_unsafe": 0,
                      f"{name}_tighter": 0, f"{name}_gap_sum": 0, f"{name}_gap_max": 0,
                      f"{name}_gap_max_at": None})
    true_batches = None
    for block_size in [b for b in range(1, chunk + 1) if chunk % b == 0]:
        tables = request_tables(chunk, model_len, block_size, max_q)
        if true_batches is None:
            true_batches = combine(tables["batches"], max_n, max_t)[1:, 1:]
        truth = {
            "batches": true_batches,
            "local_pages": combine(tables["local_pages"], max_n, max_t)[1:, 1:],
            "global_pages": combine(tables["global_pages"], max_n, max_t)[1:, 1:],
        }
        ours = {
            "batches": _virtual_batches_formula(n_grid, t_grid, chunk, model_len),
            "local_pages": _local_pages_formula(n_grid, t_grid, chunk, model_len, block_size),
            "global_pages": _global_pages_formula(n_grid, t_grid, model_len, block_size),
        }
        pub = {"batches": published, "local_pages": published * (chunk // block_size),
               "global_pages": n_grid * (-(-model_len // block_size))}
        stats["configs"] += n_grid.size
        for name in _METRICS:
            wrong = ours[name] != truth[name]
            stats[f"{name}_violations"] += int(wrong.sum())
            if wrong.any():
                i, j = np.argwhere(wrong)[0]
                stats["examples"].append((name, int(n_grid[i, j]), int(t_grid[i, j]), chunk,
                                          model_len, block_size, int(ours[name][i, j]),
                                          int(truth[name][i, j])))
            stats[f"{name}_published_unsafe"] += int((pub[name] < truth[name]).sum())
            gap = pub[name] - ours[name]
            stats[f"{name}_tighter"] += int((gap > 0).sum())
            stats[f"{name}_gap_sum"] += int(gap[gap > 0].sum())
            if gap.max() > stats[f"{name}_gap_max"]:
                i, j = np.unravel_index(np.argmax(gap), gap.shape)
                stats[f"{name}_gap_max"] = int(gap[i, j])
                stats[f"{name}_gap_max_at"] = (int(n_grid[i, j]), int(t_grid[i, j]), chunk,
                                               model_len, block_size)
    for k in range(0, min(max_k, model_len - 1) + 1):
        q = k + 1
        pieces, of_length = _verify_brute(q, chunk, model_len)
        ours_pieces = max_verify_batches(1, k, chunk, model_len)
        ours_uniform = max_uniform_verify_batches(1, k, chunk, model_len)
        ours_lengths = [max_verify_batches_of_length(1, k, chunk, ell, model_len)
                        for ell in range(1, q + 1)]
        wrong = (ours_pieces != pieces) + (ours_uniform != int(of_length.max())) + int(
            (np.asarray(ours_lengths) != of_length).sum())
        stats["verify_checks"] += 2 + q
        stats["verify_violations"] += int(wrong)
        if wrong:
            stats["examples"].append(("verify", k, chunk, model_len))
    return stats


def _merge(total, part):
    for key, value in part.items():
        if key.endswith("_gap_max"):
            if value > total.get(key, -1):
                total[key], total[key + "_at"] = value, part[key + "_at"]
        elif key.endswith("_gap_max_at"):
            continue
        elif key == "examples":
            total.setdefault(key, []).extend(value)
        else:
            total[key] = total.get(key, 0) + value
    return total


def parse_int_list(text: str) -> list[int]:
    """'1-16' or '1,2,4,8' or a mix ('1-4,8,16') -> sorted distinct positive ints."""
    if not text.strip():
        raise ValueError("empty: want '1-16' or '1,2,4'")
    values: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"cannot read {part!r} in {text!r}: want '1-16' or '1,2,4'") from None
        if first < 1 or last < first:
            raise ValueError(f"bad range {part!r} in {text!r}: want 1 <= first <= last")
        values.update(range(first, last + 1))
    return sorted(values)


def sweep(max_n: int, max_t: int, chunks, workers: int = 2, progress: bool = True,
          extra_lens=()):
    """Run the whole comparison; return the merged counts."""
    from tqdm import tqdm

    tasks = [(c, length, max_n, max_t, 3 * c + 2) for c in chunks
             for length in model_lens(c, extra_lens)]
    tasks.sort(key=lambda t: -t[0] * min(t[1], max_t))  # big tasks first: even finish
    total: dict[str, Any] = {}
    bar = tqdm(total=len(tasks), desc="verify-bounds", unit="(c,L)", disable=not progress)
    results: Iterator[dict[str, Any]]
    if workers <= 1:
        results = map(check_group, tasks)
        pool = None
    else:
        pool = multiprocessing.get_context("fork").Pool(workers)
        results = pool.imap_unordered(check_group, tasks)
    try:
        for part in results:
            _merge(total, part)
            bar.update(1)
    finally:
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()
    total["groups"] = len(tasks)
    return total


def violations(total) -> int:
    return sum(total[f"{name}_violations"] for name in _METRICS) + total["verify_violations"]


def summary(total, seconds: float, workers: int) -> str:
    configs = total["configs"]
    lines = [f"configurations (N, T, c, L, bs): {configs:,} in {total['groups']} (c, L) groups",
             f"violations (closed form != brute-force maximum): {violations(total)}"]
    labels = {"batches": "virtual batches", "local_pages": "local pages",
              "global_pages": "global pages"}
    for name in _METRICS:
        tighter = total[f"{name}_tighter"]
        mean = total[f"{name}_gap_sum"] / tighter if tighter else 0.0
        lines.append(
            f"{labels[name]:>16}: violations {total[f'{name}_violations']}, published unsafe "
            f"{total[f'{name}_published_unsafe']}, ours tighter in {tighter:,} "
            f"({100 * tighter / configs:.1f}%), mean gap {mean:.2f}, max gap "
            f"{total[f'{name}_gap_max']} at (N, T, c, L, bs) = {total[f'{name}_gap_max_at']}")
    lines.append(f"verify steps (k, c, L, q_local) checks: {total['verify_checks']:,}, "
                 f"violations {total['verify_violations']}")
    for example in total.get("examples", [])[:10]:
        lines.append(f"  mismatch: {example}")
    lines.append(f"wall time {seconds:.1f} s on {workers} worker(s)")
    return "\n".join(lines)


def plot(path: str, chunk: int = 8, model_len: int = 40, block_size: int = 2,
         ns=(1, 3, 8), max_t: int = 96) -> None:
    """True maximum (markers), ours (lines) and the published bound (dashed) against T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = request_tables(chunk, model_len, block_size, min(model_len, max_t))
    t = np.arange(1, max_t + 1)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, name, label in zip(axes, ("batches", "local_pages"),
                               ("virtual batches", "local pages"), strict=True):
        truth = combine(tables[name], max(ns), max_t)
        for color, n in zip(("C0", "C1", "C2", "C3", "C4", "C5"), ns, strict=False):
            ours = (_virtual_batches_formula(n, t, chunk, model_len) if name == "batches" else
                    _local_pages_formula(n, t, chunk, model_len, block_size))
            published = np.minimum(2 * n + (-(-t // chunk)), t)
            if name == "local_pages":
                published = published * (chunk // block_size)
            ax.plot(t, truth[n, 1:], "o", ms=2.5, color=color, label=f"N={n} true max")
            ax.plot(t, ours, "-", color=color, lw=1, label=f"N={n} ours")
            ax.plot(t, published, "--", color=color, lw=1, label=f"N={n} published")
        ax.set_xlabel("T (max_num_batched_tokens)")
        ax.set_ylabel(label)
        ax.set_title(f"{label}: c={chunk}, L={model_len}, bs={block_size}")
    axes[0].legend(fontsize=7, ncol=1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser) -> None:
    parser.add_argument("--max-n", type=positive_int, default=32, help="N = 1..MAX_N (default 32)")
    parser.add_argument("--max-t", type=positive_int, default=256,
                        help="T = 1..MAX_T (default 256)")
    parser.add_argument("--chunks", default="1-16",
                        help="chunk sizes, e.g. '1-16' or '2,4,8' (default 1-16); every block "
                             "size dividing c and ~20 model lengths around multiples of c")
    parser.add_argument("--lens", default="",
                        help="extra max_model_len values added to the default set, e.g. '7,500'")
    parser.add_argument("--workers", type=positive_int, default=2, help="processes (default 2)")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG of true max/ours/published")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def check_arguments(parser, args) -> None:
    """Bad lists and an unwritable --plot stop the command before the sweep (exit 2)."""
    for flag, text in (("--chunks", args.chunks), ("--lens", args.lens)):
        try:
            if text or flag == "--chunks":  # no extra lengths is fine, no chunk sizes is not
                parse_int_list(text)
        except ValueError as err:
            parser.error(f"argument {flag}: {err}")
    if args.plot:
        if not Path(args.plot).resolve().parent.is_dir():
            parser.error(f"argument --plot: folder of {args.plot!r} does not exist")
        try:
            from matplotlib.figure import Figure
        except ImportError:
            parser.error('argument --plot: needs matplotlib (pip install "chunklocal[plot]")')
        formats = Figure().canvas.get_supported_filetypes()
        suffix = Path(args.plot).suffix.lower().lstrip(".")
        if suffix not in formats:
            parser.error(f"argument --plot: {args.plot!r} is not an image format matplotlib "
                         f"writes (use one of .{', .'.join(sorted(formats))})")


def main(args) -> int:
    chunks = parse_int_list(args.chunks)
    extra = parse_int_list(args.lens) if args.lens else []
    began = time.perf_counter()
    total = sweep(args.max_n, args.max_t, chunks, args.workers, not args.quiet, extra)
    print(summary(total, time.perf_counter() - began, args.workers))
    if args.plot:
        plot(args.plot)
        print(f"wrote {args.plot}")
    return 1 if violations(total) else 0
