"""Which files under src/ one decode token passes through, from LLM.generate() to the kernel.

A tiny random Llama-4 (transformers, float32, c = 32) is served on the CPU.  After a
warm-up call (lazy imports and first-use paths are not counted), one
``LLM.generate([prompt], max_new_tokens=2)`` runs under ``sys.setprofile``: its first
step is the prefill, its second a decode step.  Every Python function entered is
recorded with its file; calls to ``Scheduler.schedule`` split the trace into steps.
The decode token's files are those entered before the first step (generate's own
checks) and during the decode step, up to and including the attention kernel call
(``run_paged_attention`` on the CPU; sampling and bookkeeping after it touch files
already counted, and are listed separately).

    python -m benchmarks.decode_trace            # table
    python -m benchmarks.decode_trace --json     # machine-readable
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parent.parent / "src"
KERNEL = "run_paged_attention"  # the CPU backend's kernel call (chunklocal/reference.py)


def write_checkpoint(path: Path) -> None:
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, intermediate_size_mlp=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        attention_chunk_size=32, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, max_position_embeddings=256, initializer_range=0.1,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    Llama4ForCausalLM(config).save_pretrained(str(path))


def trace_decode(model_dir: Path, prompt_len: int = 40) -> dict:
    """Files (relative to src/) entered per phase of a prefill + one decode step."""
    import chunklocal

    llm = chunklocal.LLM(model_dir, device="cpu", max_num_seqs=2, max_num_batched_tokens=64,
                         max_model_len=128)
    prompt = [(7 * i) % 256 for i in range(prompt_len)]
    src = str(SRC) + "/"
    active = [False]
    phases: list[list[str]] = [[]]  # phase 0: before the first schedule(); then one per step
    kernel_reached = [False, False]  # in the decode step: (entered kernel, first file after)
    after_kernel: list[str] = []

    def profile(frame, event, arg):
        if event != "call" or not active[0]:
            return
        path = frame.f_code.co_filename
        if not path.startswith(src):
            return
        rel = path[len(src):]
        if frame.f_code.co_name == "schedule" and rel.endswith("engine/scheduler.py"):
            phases.append([])
        step = len(phases) - 1
        if step == 2 and kernel_reached[0]:
            if rel not in after_kernel:
                after_kernel.append(rel)
            return
        if rel not in phases[-1]:
            phases[-1].append(rel)
        if step == 2 and frame.f_code.co_name == KERNEL:
            kernel_reached[0] = True

    # generate() runs in the caller's thread, the steps in the engine core's loop thread
    # (started by the warm-up, which installs the profile it inherits, still inactive).
    threading.setprofile(profile)
    try:
        llm.generate([prompt], max_new_tokens=2, ignore_eos=True, use_tqdm=False)  # warm-up
        sys.setprofile(profile)
        active[0] = True
        llm.generate([prompt], max_new_tokens=2, ignore_eos=True, use_tqdm=False)
    finally:
        active[0] = False
        sys.setprofile(None)
        threading.setprofile(None)
    if len(phases) != 3 or not kernel_reached[0]:
        raise RuntimeError(f"expected setup + prefill + decode phases reaching {KERNEL}, got "
                           f"{len(phases) - 1} steps")
    path = list(dict.fromkeys(phases[0] + phases[2]))
    return dict(decode_files=path, count=len(path), setup_files=phases[0],
                decode_step_files=phases[2],
                after_kernel_new=[f for f in after_kernel if f not in path])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: tiny random)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = Path(tmp) / "tiny-llama4"
            write_checkpoint(model_dir)
        result = trace_decode(model_dir)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['count']} files under src/ from LLM.generate() to {KERNEL}:")
        for f in result["decode_files"]:
            print(f"  {f}")
        if result["after_kernel_new"]:
            print("entered only after the kernel call: " + ", ".join(result["after_kernel_new"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
