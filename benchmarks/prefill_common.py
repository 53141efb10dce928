"""Shared pieces of the prefill scripts (issue 14): the backend under test, random
chunked-local batches, the float32 reference and per-(row, head) error counts.

Nothing here imports FlashInfer or needs CUDA at import time, so the CPU smoke
tests can run the batch generation, the reference and the error accounting.

* :func:`flashinfer_backend_class` finds ``FlashInferBackend`` whether
  ``chunklocal.backends.flashinfer`` is a module (today) or a package (the
  layout reorg moves the class to ``chunklocal.backends.flashinfer.backend``),
  so the scripts test the backend that ships.
* :func:`random_batch` draws one step: 1-16 requests, ragged prefixes (none,
  chunk-aligned, arbitrary) and query lengths (decodes, short, up to two
  chunks), distinct random pages from a shared pool.  At least one request has
  more than one query, so the step takes the prefill kernel, not the decode one.
* :func:`row_errors` compares an output with the reference per (row, head):
  ``||out - ref|| / ||ref||`` over the head dimension; a non-finite output
  counts as off.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks import workloads as wl
from benchmarks.common import write_json

#: Chunk sizes the stress draws from: powers of two and odd multiples of the page
#: (so chunk and CTA tile boundaries fall at many relative offsets).
STRESS_CHUNKS = (256, 272, 496, 512, 1040, 2048, 3008, 4096, 8192)
OFF_THRESHOLD = 0.05


def flashinfer_backend_class():
    """``FlashInferBackend`` from wherever the current layout keeps it."""
    errors = []
    for name in ("chunklocal.backends.flashinfer", "chunklocal.backends.flashinfer.backend"):
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        cls = getattr(module, "FlashInferBackend", None)
        if cls is not None:
            return cls
        errors.append(f"{name}: no FlashInferBackend")
    raise ImportError("FlashInferBackend not found: " + "; ".join(errors))


def engine_limits(max_num_seqs: int, max_tokens: int, max_model_len: int,
                  block: int = wl.BLOCK):
    from chunklocal.backends.base import EngineLimits

    model_len = -(-int(max_model_len) // block) * block
    return EngineLimits(max_num_seqs=int(max_num_seqs), max_num_batched_tokens=int(max_tokens),
                        max_model_len=int(model_len), block_size=block)


def make_backend(chunk: int, kernel: str, limits, device, dtype=None):
    """A chunked-layer FlashInferBackend with prefill kernel ``kernel`` ("fa2" / "fa3")."""
    import torch

    from benchmarks.library import specs

    cls = flashinfer_backend_class()
    return cls(specs(chunk, limits.block_size, dtype or torch.bfloat16)[0], limits,
               wl.NUM_Q_HEADS, wl.NUM_KV_HEADS, wl.HEAD_DIM, dtype or torch.bfloat16, device,
               prefill_backend=kernel)


@dataclass(frozen=True)
class StressBatch(wl.StepLens):
    """One step: int32 numpy ``query_start_loc`` [N+1], ``seq_lens`` [N], ``block_table``
    [N, W] (unused columns 0), and the chunk size it is run with."""

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    chunk: int

    def describe(self) -> dict:
        q = self.query_lens
        return {"chunk": self.chunk, "num_reqs": int(q.shape[0]), "tokens": self.num_tokens,
                "max_seq": int(self.seq_lens.max()), "decodes": int((q == 1).sum())}


def random_batch(rng: np.random.Generator, chunk: int, num_pages: int, *,
                 max_reqs: int = 16, max_tokens: int = 8192,
                 block: int = wl.BLOCK) -> StressBatch:
    """A random chunked-local step (see module doc); pages are distinct, never page 0."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens {max_tokens} leaves no room for a prefill (2 tokens)")
    n = int(rng.integers(1, min(max_reqs, max_tokens - 1) + 1))  # room for one prefill
    kind = rng.choice(4, size=n, p=[0.25, 0.25, 0.3, 0.2])
    short = min(64, chunk)
    q = np.select([kind == 0, kind == 1, kind == 2],
                  [np.ones(n, np.int64), rng.integers(2, short + 1, n),
                   rng.integers(short, chunk + 1, n)],
                  rng.integers(chunk, 2 * chunk + 1, n))
    if q.sum() > max_tokens:  # scale down, keeping every request at >= 1 query
        q = np.maximum(1, (q * (max_tokens - n)) // q.sum())
    if (q == 1).all():
        q[0] = min(int(rng.integers(2, chunk + 1)), max_tokens - (n - 1))
    mode = rng.choice(3, size=n, p=[0.4, 0.2, 0.4])
    prefix = np.select([mode == 0, mode == 1],
                       [np.zeros(n, np.int64), rng.integers(1, 3, n) * chunk],
                       rng.integers(0, 3 * chunk + 1, n))
    seq = prefix + q
    pages = -(-seq // block)
    if pages.sum() > num_pages - 1:
        raise ValueError(f"batch needs {int(pages.sum())} pages, the pool has {num_pages - 1}")
    ids = rng.choice(num_pages - 1, size=int(pages.sum()), replace=False) + 1
    table = np.zeros((n, int(pages.max())), np.int32)
    table[np.arange(table.shape[1])[None, :] < pages[:, None]] = ids
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    return StressBatch(qsl, seq.astype(np.int32), table, int(chunk))


def reporter_batch(tokens: int = 36000, chunk: int = wl.CHUNK, *, seed: int = 0,
                   num_pages: int | None = None, block: int = wl.BLOCK) -> StressBatch:
    """The reporter's prompt: one fresh request of ``tokens`` tokens on random distinct pages."""
    pages = -(-tokens // block)
    pool = num_pages or pages + 1
    ids = np.random.default_rng(seed).choice(pool - 1, size=pages, replace=False) + 1
    return StressBatch(np.array([0, tokens], np.int32), np.array([tokens], np.int32),
                       ids.astype(np.int32)[None, :], int(chunk))


def random_pool(num_pages: int, device, seed: int, block: int = wl.BLOCK):
    """Random normal bf16 K and V pools [pages, block, Hkv, D] (NHD)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (num_pages, block, wl.NUM_KV_HEADS, wl.HEAD_DIM)
    return tuple(torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
                 for _ in range(2))


def random_queries(tokens: int, device, seed: int):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(tokens, wl.NUM_Q_HEADS, wl.HEAD_DIM, device=device,
                       dtype=torch.bfloat16, generator=gen)


def reference(q, k_f32, v_f32, batch: StressBatch, scale: float):
    """float32 chunked-local attention through ``chunklocal.reference`` (virtual batches,
    then row tiles within a fixed memory budget): [tokens, Hq, D] float32."""
    from chunklocal.reference import reference_attention

    return reference_attention(q.float(), k_f32, v_f32, batch.query_start_loc, batch.seq_lens,
                               batch.block_table, chunk_size=batch.chunk, scale=scale)


def row_errors(out, ref):
    """Relative error per (row, head) [tokens, Hq] float32; non-finite rows get +inf."""
    import torch

    diff = (out.float() - ref).norm(dim=-1)
    err = diff / ref.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    finite = torch.isfinite(out).all(dim=-1)
    return torch.where(finite, err, torch.full_like(err, math.inf))


def summarize(err, threshold: float = OFF_THRESHOLD) -> dict:
    """Counts of (row, head) pairs and rows above ``threshold``, and the worst pair."""
    import torch

    off = err > threshold
    flat = int(torch.argmax(torch.nan_to_num(err, posinf=3.4e38)).item()) if err.numel() else 0
    heads = err.shape[1] if err.dim() == 2 else 1
    worst = float(err.reshape(-1)[flat]) if err.numel() else 0.0
    return {"pairs": int(err.numel()), "pairs_off": int(off.sum()),
            "rows_off": int(off.any(dim=-1).sum()) if err.dim() == 2 else int(off.sum()),
            "nonfinite_pairs": int(torch.isinf(err).sum()), "worst": worst,
            "worst_row": flat // heads, "worst_head": flat % heads}


def merge_summary(total: dict | None, part: dict) -> dict:
    """Accumulate :func:`summarize` results over batches (worst keeps its location)."""
    if total is None:
        return dict(part)
    out = {k: total[k] + part[k] for k in ("pairs", "pairs_off", "rows_off", "nonfinite_pairs")}
    best = part if part["worst"] > total["worst"] else total
    out.update({k: best[k] for k in best if k.startswith("worst")})
    return out


def save(payload: dict, out: Path | None, name: str) -> Path:
    """``--out`` as a ``.json`` file path or as a directory (``<dir>/<name>.json``)."""
    if out is not None and str(out).endswith(".json"):
        path = Path(out)
        tmp_dir = path.parent
        written = write_json(name, payload, tmp_dir)
        if written != path:
            written.replace(path)
        return path
    return write_json(name, payload, out)


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())
