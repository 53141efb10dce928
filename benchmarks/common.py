"""Timing, ceilings, tables and JSON output shared by every benchmark script.

Device times are CUDA-event medians after a warm-up (METHOD.md: asynchronous work
must be timed on the device); host times are ``perf_counter_ns`` medians.  Each
script writes one JSON file with the machine it ran on, so a table in
BENCHMARKS.md can always be traced back to a run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes and few repeats: checks the script runs, measures nothing")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"directory for the JSON result (default {RESULTS_DIR})")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repetitions per measurement (median reported)")
    return parser


def device_parser(description: str, cpu_help: str = "cpu only with --smoke"
                  ) -> argparse.ArgumentParser:
    """``base_parser`` plus ``--device`` (cuda / cpu, default cuda where there is one)."""
    import torch

    parser = base_parser(description)
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu", help=cpu_help)
    return parser


def parse_device_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, refusing a full-size (not ``--smoke``) run on the CPU."""
    args = parser.parse_args(argv)
    if args.device == "cpu" and not args.smoke:
        parser.error("the full-size run needs CUDA; on the CPU only --smoke works")
    return args


def cpu_time_us(fn: Callable[[], object], repeats: int = 200, warmup: int = 10) -> dict:
    """Median / p10 / p90 wall time of ``fn()`` on the host, in microseconds."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return _summary(samples)


def cuda_time_ms(fn: Callable[[], object], repeats: int = 30, warmup: int = 5) -> dict:
    """Median / p10 / p90 device time of ``fn()`` between CUDA events, in milliseconds.

    Each repetition is bracketed by its own event pair, so host work inside
    ``fn`` that does not overlap the device shows up too (that is the point for
    steps that include metadata building).
    """
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return _summary([s.elapsed_time(e) for s, e in pairs])


def _summary(samples: Sequence[float]) -> dict:
    ordered = sorted(samples)
    n = len(ordered)
    return {
        "median": statistics.median(ordered),
        "p10": ordered[int(0.1 * (n - 1))],
        "p90": ordered[int(0.9 * (n - 1))],
        "n": n,
    }


def measure_copy_bytes_per_s(device, nbytes: int = 2 << 30, repeats: int = 20) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), repeats=repeats)["median"]
    return 2 * nbytes / (ms * 1e-3)


def measure_matmul_flops(device, n: int = 8192, repeats: int = 20) -> float:
    """bf16 matrix-product rate on random (never zero) data, FLOP/s."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: torch.matmul(a, b, out=out), repeats=repeats)["median"]
    return 2 * n**3 / (ms * 1e-3)


def measure_ceilings(smoke: bool) -> dict:
    """The CUDA copy and bf16 matmul rates (small sizes with ``smoke``), printed."""
    ceilings = {
        "copy_bytes_per_s": measure_copy_bytes_per_s("cuda", (64 << 20) if smoke else (2 << 30)),
        "matmul_flops": measure_matmul_flops("cuda", 1024 if smoke else 8192),
    }
    print(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), "
          f"bf16 matmul {ceilings['matmul_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    return ceilings


def machine_info() -> dict:
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import numpy
        import torch

        info["torch"] = torch.__version__
        info["numpy"] = numpy.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    try:
        import flashinfer

        info["flashinfer"] = flashinfer.__version__
    except Exception:  # noqa: BLE001 - absent or broken: the JSON just says nothing
        pass
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def format_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """A plain-text (also valid Markdown) table of ``rows``."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    cells = [[_fmt(row.get(col, "")) for col in columns] for row in rows]
    widths = [max(len(col), *(len(r[i]) for r in cells)) for i, col in enumerate(columns)]

    def line(values):
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(columns), rule, *(line(r) for r in cells)])


def _fmt(value) -> str:
    if isinstance(value, float):
        if value == 0 or 0.01 <= abs(value) < 1e5:
            return f"{value:.3g}" if abs(value) < 10 else f"{value:,.1f}"
        return f"{value:.3g}"
    return str(value)


def write_json(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    """Write ``payload`` (plus machine info) to ``<out_dir>/<name>.json``; return the path."""
    out_dir = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    data = {"benchmark": name, "machine": machine_info(), **payload}
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
    return path


def _json_default(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def guarded(name: str, fn: Callable[[], object], errors: list) -> object:
    """Run one benchmark case; on failure record the error and carry on with the next."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others
        import traceback

        traceback.print_exc()
        errors.append({"case": name, "error": f"{type(exc).__name__}: {exc}"})
        print(f"[{name}] FAILED: {type(exc).__name__}: {exc}", flush=True)
        return None
