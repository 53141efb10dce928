"""Render the benchmark JSON files as the Markdown tables of BENCHMARKS.md, and the plots.

``python -m benchmarks.report [--results DIR] [--plots DOCS_DIR]`` prints one
table per result file found (kernel_floor, metadata_*, metadata_stages,
cuda_graphs, engine) and writes PNG plots (matplotlib, Agg) next to the docs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.common import RESULTS_DIR, base_parser, format_table

TABLES = {
    "kernel_floor": ["case", "chunklocal_ms", "TFLOP/s", "TB/s", "fraction_of_ceiling",
                     "chunklocal_fa3_ms", "fa3_TFLOP/s", "fa3_fraction_of_ceiling",
                     "full_causal/chunklocal", "flex/chunklocal", "sdpa/chunklocal",
                     "virtual_batches", "chunklocal_rel_err"],
    "metadata_cpu": ["case", "build", "build_us", "p10_us", "p90_us", "chunked_build_us",
                     "global_build_us", "virtual_batches"],
    "metadata_cuda": ["case", "build", "build_us", "chunked_build_us", "global_build_us",
                      "attention_us_48_layers", "fraction_of_attention"],
    "metadata_stages": ["layers", "stage", "median_us", "p10_us", "p90_us"],
    "cuda_graphs": ["batch", "eager_ms", "eager_forward_only_ms", "graph_host_md_ms",
                    "speedup_host_md"],
    "engine": ["engine", "workload", "seconds", "tokens/s", "new_tokens/s", "steps",
               "peak_virtual_batches"],
}


def load(results: Path, name: str):
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def machine_line(data) -> str:
    m = data["machine"]
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    fi = f", flashinfer {m['flashinfer']}" if m.get("flashinfer") else ""
    return (f"{m['date_utc']}; {m.get('cpu')} x{m.get('cpu_count')}{gpu}; torch "
            f"{m.get('torch')}{fi}")


def plots(results: Path, docs: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    data = load(results, "kernel_floor")
    if data and data["rows"]:
        rows = data["rows"]
        prefill = [r for r in rows if "TFLOP/s" in r]
        decode = [r for r in rows if "TB/s" in r]
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        ax = axes[0]
        y = list(range(len(prefill)))
        ax.barh([i + 0.2 for i in y], [r.get("fraction_of_ceiling", 0) for r in prefill], 0.4,
                label="chunklocal default (FA2)")
        ax.barh([i - 0.2 for i in y], [r.get("fa3_fraction_of_ceiling", 0) for r in prefill],
                0.4, label="chunklocal, prefill_backend='auto' (FA3)")
        ax.set_yticks(y, [r["case"] for r in prefill], fontsize=7)
        ax.axvline(0.70, ls="--", color="gray", label="target 70%")
        ax.set_xlim(0, 1)
        ax.set_xlabel("useful TFLOP/s / measured bf16 matmul rate")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.4, -0.28), ncol=2)
        ax = axes[1]
        y = list(range(len(decode)))
        ax.barh(y, [r.get("fraction_of_ceiling", 0) for r in decode], 0.5, color="tab:green")
        ax.set_yticks(y, [r["case"] for r in decode], fontsize=7)
        ax.axvline(0.85, ls="--", color="gray", label="target 85%")
        ax.set_xlim(0, 1.15)
        ax.set_xlabel("KV bytes read per s / measured copy rate")
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        written.append(_save(fig, docs / "bench_kernel_floor.png"))
    data = load(results, "metadata_cuda") or load(results, "metadata_cpu")
    if data and data["rows"]:
        rows = data["rows"]
        cases = list(dict.fromkeys(r["case"] for r in rows))
        hows = list(dict.fromkeys(r["build"] for r in rows))
        fig, ax = plt.subplots(figsize=(8, 3.5))
        width = 0.8 / len(hows)
        for i, how in enumerate(hows):
            vals = [next(r["build_us"] for r in rows if r["case"] == c and r["build"] == how)
                    for c in cases]
            ax.bar([j + i * width for j in range(len(cases))], vals, width, label=how)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], cases, fontsize=7)
        if "attention_us_48_layers" in rows[0]:
            attention = [next(r["attention_us_48_layers"] for r in rows if r["case"] == c)
                         for c in cases]
            ax.scatter([j + 0.4 - width / 2 for j in range(len(cases))],
                       [0.05 * a for a in attention], marker="_", s=900, color="red",
                       label="5% of the step's attention (48 layers)", zorder=3)
        ax.set_yscale("log")
        ax.set_ylabel("build time per step (us), log")
        ax.axhline(100, ls="--", color="gray", label="100 us")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, docs / "bench_metadata.png"))
    data = load(results, "cuda_graphs")
    if data and data["rows"]:
        rows = data["rows"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        b = [r["batch"] for r in rows]
        for key, label in (("eager_ms", "eager (build + 2 layers)"),
                           ("eager_forward_only_ms", "eager, kernels only (no build)"),
                           ("graph_host_md_ms", "graph, host metadata"),
                           ("graph_device_md_ms", "graph, device metadata")):
            if key in rows[0]:  # results from before the device path was removed have it
                ax.plot(b, [r[key] for r in rows], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("decode batch size")
        ax.set_ylabel("ms per step (chunked + global layer)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, docs / "bench_cuda_graphs.png"))
    return written


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("--plots", type=Path, default=None,
                        help="directory for PNG plots (default: none)")
    args = parser.parse_args(argv)
    for name, columns in TABLES.items():
        data = load(args.results, name)
        if data is None:
            continue
        print(f"## {name}\n\n{machine_line(data)}\n")
        if data.get("ceilings"):
            c = data["ceilings"]
            print(f"ceilings: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
                  f"{c['matmul_flops'] / 1e12:.0f} TFLOP/s\n")
        print(format_table(data["rows"], columns))
        if data.get("errors"):
            print(f"\nerrors: {data['errors']}")
        print()
    if args.plots:
        for path in plots(args.results, args.plots):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
