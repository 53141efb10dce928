"""Compile the FlashInfer kernels the engine uses on this CPU machine, for sm_90a, so that a
device call loads them instead of compiling them (15-80 s each on the device, about 4
minutes of a cold session's first call).

This machine has nvcc 13.0 and the CUDA headers but no GPU.  FlashInfer loads a module
from ``flashinfer/data/aot/<name>/<name>.so`` before it looks at its JIT cache, with no
freshness check (``jit.env.get_aot_artifacts``), so modules built here and copied there
on the device are used as they are; ``benchmarks/device_calls.sh`` unpacks
``.fi-aot.tgz`` into the installed package when the call carries it.  A module missing
from the archive is compiled on the device as before.

    pip download --no-deps --only-binary=:all: apache-tvm-ffi==0.1.15.post2 -d /tmp/fiw
    pip install --no-deps --target /tmp/fisite /tmp/fiw/*.whl nvidia-ml-py einops \\
        nvidia-curand .whl/flashinfer_python-*.whl
    PYTHONPATH=/tmp/fisite python tools/flashinfer_aot.py   # writes .fi-aot.tgz, then checks it

The link asks for the driver (``-lcuda``), which a machine without a GPU lacks; the tool
links against an empty stand-in with its soname (the modules end up not needing it).  The
sampling kernels and FA3's include ``curand_kernel.h`` (header-only), which this CUDA install
lacks: the tool adds ``nvidia-curand``'s include folder, found on ``sys.path``.

The module list follows what the engine asks for (backends/flashinfer, models/fused.py,
engine/sampler.py) at Llama-4's head_dim 128: the FA2 paged prefill kernel (which the
tensor-core decode wrapper also runs) for bf16 and FP8 KV, the FA3 one with
``--fa3`` (its module also holds the ragged kernel of ``CHUNKLOCAL_RAGGED_OWN_KEYS``),
``silu_and_mul``, the sampling kernels and ``cascade`` (``merge_state``).  Each module's
name is FlashInfer's own (its generator functions are called here), so a device asking for
it finds it.  The tool ends by loading the archive as the device will (``check``: unpacked
into the package's ``data/aot``, a fresh process, JIT disabled): a module FlashInfer would
not take from there fails it (a module left out of the archive did: ``AssertionError:
sampling``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def specs(fa3: bool):
    import torch
    from flashinfer.jit.activation import gen_act_and_mul_module
    from flashinfer.jit.attention.modules import (
        _gen_batch_prefill_primary_module,
        gen_batch_prefill_module,
    )
    from flashinfer.jit.cascade import gen_cascade_module
    from flashinfer.jit.sampling import gen_sampling_module

    bf16, idx = torch.bfloat16, torch.int32
    out = []
    for kv in (bf16, torch.float8_e4m3fn):
        # (backend, q, kv, o, idx, head_dim_qk, head_dim_vo, posenc NONE, no window,
        # no soft cap, no fp16 qk reduction): what the wrappers' plan() passes
        args = (bf16, kv, bf16, idx, 128, 128, 0, False, False, False)
        out.append(_gen_batch_prefill_primary_module("fa2", *args))
        if fa3 and kv is bf16:  # FA3 takes FP8 KV only beside FP8 queries
            out.append(gen_batch_prefill_module("fa3", *args))
    out.append(gen_act_and_mul_module("silu"))
    out.append(gen_sampling_module())
    out.append(gen_cascade_module())  # merge_state: the ragged path's LSE merge
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".fi-aot.tgz")
    parser.add_argument("--fa3", action="store_true", help="also the FA3 (sm90) prefill kernels")
    parser.add_argument("--workspace", type=Path, default=None,
                        help="FlashInfer's JIT cache folder (default: a temporary one)")
    args = parser.parse_args(argv)
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    work = args.workspace or Path(tempfile.mkdtemp(prefix="fi-aot-"))
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(work)  # read when flashinfer imports
    if shutil.which("nvcc") is None:
        print("flashinfer_aot: no nvcc on this machine", file=sys.stderr)
        return 2
    if "CUDA_HOME" not in os.environ and Path("/usr/local/cuda/lib64").is_dir():
        os.environ["CUDA_HOME"] = "/usr/local/cuda"  # where libcudart is (the link needs it)
    stub = work / "libcuda-stub"
    stub.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cc", "-shared", "-x", "c", "-", "-o", str(stub / "libcuda.so"),
                    "-Wl,-soname,libcuda.so.1"], input=b"", check=True)
    os.environ["FLASHINFER_EXTRA_LDFLAGS"] = f"-L{stub}"
    curand = [Path(p) / "nvidia" / "cu13" / "include" for p in sys.path if p]
    curand = [p for p in curand if (p / "curand_kernel.h").exists()]
    if curand:
        os.environ["FLASHINFER_EXTRA_CUDAFLAGS"] = f"-I{curand[0]}"
    built = []
    for spec in specs(args.fa3):
        start = time.time()
        spec.build()
        path = spec.jit_library_path
        print(f"{spec.name}: {time.time() - start:.0f} s, "
              f"{path.stat().st_size / 2**20:.1f} MiB", flush=True)
        built.append((spec.name, path))
    with tarfile.open(args.out, "w:gz") as tar:
        for name, path in built:
            tar.add(path, arcname=f"{name}/{name}.so")
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB, "
          f"{len(built)} modules)")
    return check(args.out, args.fa3)


CHECK = """
from tools.flashinfer_aot import specs
for spec in specs({fa3}):
    assert spec.is_aot, spec.name
    spec.build_and_load()  # FLASHINFER_DISABLE_JIT: a build would raise
    print("loads without a build:", spec.name)
"""


def check(archive: Path, fa3: bool) -> int:
    """Load every module of ``archive`` as the device will: unpacked into the installed
    package's ``data/aot``, in a fresh process with an empty JIT cache and JIT disabled
    (so a module FlashInfer did not take from ``data/aot`` raises instead of building)."""
    from flashinfer.jit import env

    aot = env.FLASHINFER_AOT_DIR
    if aot.exists():
        print(f"flashinfer_aot: {aot} exists already; not checking", file=sys.stderr)
        return 1
    cuda_lib = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "lib64"
    try:
        aot.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            tar.extractall(aot, filter="data")
        with tempfile.TemporaryDirectory() as empty:
            env_vars = dict(os.environ, FLASHINFER_WORKSPACE_BASE=empty,
                            FLASHINFER_DISABLE_JIT="1",
                            LD_LIBRARY_PATH=f"{cuda_lib}:{os.environ.get('LD_LIBRARY_PATH', '')}",
                            PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path[1:]))
            done = subprocess.run([sys.executable, "-c", CHECK.format(fa3=fa3)],
                                  env=env_vars, cwd=ROOT)
        return done.returncode
    finally:
        shutil.rmtree(aot, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
