"""Triton kernels compiled for sm_90 on a machine without a GPU, and the opcodes of
their loops (Triton ships ptxas and nvdisasm): what the device would run, read on the CPU.

tests/test_triton_sm90.py compiles every kernel of the package with these; run as a
script it prints the K loop of each FP8 GEMV form at Scout's experts' w13 shape (a
batch-1 step: 17 groups, the routed and the shared one with a row each), compiled with the
specialisation the JIT gives a device launch: its instructions per weight byte and its
conversions (the numbers behind ``gemv_triton``'s comments; BENCHMARKS.md)::

    python -m benchmarks.sass_loops
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
           torch.float8_e4m3fn: "*fp8e4nv", torch.int32: "*i32", torch.int64: "*i64",
           torch.uint8: "*u8"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl")


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the
    launch instead of running it."""

    def __init__(self, fn):
        self.fn, self.launches = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def scalar_type(value) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {value!r}")


def compile_launch(fn, args, kwargs, as_jit: bool = False):
    """The recorded launch's kernel, compiled for sm_90 (constexprs and launch options as
    given): the signature names every parameter, so a missing or unknown one fails.
    ``as_jit``: with the specialisation Triton's JIT gives a launch on the device (pointers
    16-byte aligned, integers that are multiples of 16 marked so, integers equal to 1 as
    constants; ``do_not_specialize`` honoured), which decides vector widths and the MMA
    kind, so the machine code is the device's."""
    options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
    bound = dict(zip(fn.arg_names, args, strict=False)) | kwargs
    assert set(bound) == set(fn.arg_names), (fn.__name__, set(fn.arg_names) ^ set(bound))
    keep = {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(fn.params):
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        specialised = as_jit and type(value) is int and param.name not in keep
        if (as_jit and isinstance(value, torch.Tensor)) or (specialised and value % 16 == 0):
            attrs[(index,)] = [["tt.divisibility", 16]]
        if specialised and value == 1:
            signature[param.name], constexprs[param.name] = "constexpr", 1
        elif isinstance(value, torch.Tensor):
            signature[param.name] = POINTER[value.dtype]
        else:
            signature[param.name] = scalar_type(value)
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=SM90, options=options)


def k_loop_ops(kernel) -> list[Counter]:
    """Each loop of ``kernel``'s sm_90 machine code (a backward branch to a label; inner
    loops first), as counts of its opcodes (``nvdisasm``, shipped with Triton)."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([str(nvdisasm), "-c", cubin.name], capture_output=True,
                              text=True, check=True).stdout
    instructions, labels, label = [], {}, None
    for line in sass.splitlines():
        if match := re.match(r"\s*(\.L_x_\d+):", line):
            label = match.group(1)
        elif match := re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            address = int(match.group(1), 16)
            instructions.append((address, match.group(2).split()))
            if label:
                labels[label], label = address, None
    loops = []
    for address, words in instructions:
        target = re.match(r"`?\(?(\.L_x_\d+)", words[-1]) if "BRA" in words[:2] else None
        if target and labels.get(target.group(1), address) < address:
            start = labels[target.group(1)]
            loops.append(Counter((w[1] if w[0].startswith("@") else w[0]).split(".")[0]
                                 for a, w in instructions if start <= a <= address))
    return sorted(loops, key=lambda ops: sum(ops.values()))


def gemv_rows() -> list[dict]:
    """A row per FP8 GEMV form: K-loop opcodes per weight byte of a thread."""
    from chunklocal.models import gemv_triton

    offs = torch.full((17,), 2, dtype=torch.int32)
    offs[-2] = 1
    w, scale = torch.zeros(17, 16384, 5120, dtype=torch.float8_e4m3fn), torch.ones(17, 16384)
    rows = torch.zeros(2, 5120, dtype=torch.float8_e4m3fn), torch.ones(2, 1)
    out = []
    forms = (("elementwise", "_gemv_kernel", dict(mma=False, partial=False)),
             ("partial sums", "_gemv_kernel", dict(mma=False, partial=True)),
             ("tensor cores", "_gemv_mma_kernel", dict(mma=True)))
    for label, name, keywords in forms:
        real = getattr(gemv_triton, name)
        recorder = Recorder(real)
        setattr(gemv_triton, name, recorder)
        try:
            gemv_triton.fp8_gemv(*rows, torch.bfloat16, w, scale, offs, **keywords)
        finally:
            setattr(gemv_triton, name, real)
        (_grid, args, kwargs), = recorder.launches
        tile = (kwargs["BLOCK_N"], kwargs["BLOCK_K"], kwargs["num_warps"])
        ops = k_loop_ops(compile_launch(real, args, dict(kwargs), as_jit=True))[0]
        per_thread = tile[0] * tile[1] / (32 * tile[2])  # weight bytes a K step
        out.append({"form": label, "tile": tile, "bytes_a_thread": per_thread,
                    "instructions_a_byte": sum(ops.values()) / per_thread,
                    **{f"{op}_a_byte": ops[op] / per_thread
                       for op in ("F2FP", "HADD2", "FFMA", "FADD", "QGMMA", "HMMA", "LDG",
                                  "LDGSTS")}})
    return out


def main() -> int:
    for row in gemv_rows():
        print(f"{row['form']:13} tile {row['tile']}: {row['instructions_a_byte']:.2f} "
              f"instructions a weight byte; " + ", ".join(
                  f"{key[:-7]} {value:.3f}" for key, value in row.items()
                  if key.endswith("_a_byte") and key != "instructions_a_byte" and value))
    return 0


if __name__ == "__main__":
    sys.exit(main())
