"""KV-cache specs: what one KV-cache group stores and how its layers attend.

A *group* is a set of layers sharing one page pool and one block table.  In
hybrid mode Llama-4 has one group of global layers and one (or more) of chunked
layers; in merged mode every layer lives in a single group whose spec is a
:class:`FullAttentionSpec` that still carries ``attention_chunk_size``.

Question from vLLM PR 50022: may a merged group keep ``attention_chunk_size``
while its consistency check ignores it?  Here it may not: :func:`merge` compares
the chunk size like every other field and raises on two different chunk sizes,
so a merged spec's chunk size is the one chunk size of all its chunked layers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from chunklocal._validate import as_bool, as_int

if TYPE_CHECKING:
    import torch


def softmax_scale(head_dim: int) -> float:
    """The attention softmax scale of a head of ``head_dim`` (1 / sqrt(D)): the one
    place it is derived (model, backends and reference read it from here)."""
    return float(head_dim) ** -0.5


class Kind(enum.Enum):
    """How a layer attends: within its chunk (RoPE layers) or over the whole sequence."""

    CHUNKED = "chunked"
    GLOBAL = "global"


@dataclass(frozen=True)
class FullAttentionSpec:
    """Pages for layers that attend causally; may carry a chunk size (merged mode)."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    attention_chunk_size: int | None = None
    sliding_window: int | None = None
    #: True when the group mixes global and chunked layers, so page sizing must
    #: cover whole sequences for the global ones.  Set by :func:`merge`.
    has_global_layers: bool = True

    def __post_init__(self):
        for name in ("block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if as_int(value, f"{type(self).__name__}.{name}") <= 0:
                raise ValueError(f"{type(self).__name__}.{name} must be positive, got {value}")
        import torch  # here, not at the top: sizing (bounds/) reads specs without torch

        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"{type(self).__name__}.dtype must be a torch.dtype, "
                             f"got {self.dtype!r}")
        as_bool(self.has_global_layers, f"{type(self).__name__}.has_global_layers")
        window = self.sliding_window
        if window is not None and as_int(window, f"{type(self).__name__}.sliding_window") <= 0:
            raise ValueError(f"sliding_window must be positive, got {window}")
        chunk = self.attention_chunk_size
        if chunk is not None and (as_int(chunk, "attention_chunk_size") <= 0
                                  or chunk % self.block_size):
            raise ValueError(
                f"attention_chunk_size {chunk} must be a positive multiple of "
                f"block_size {self.block_size}"
            )

    @property
    def page_size_bytes(self) -> int:
        """Bytes of K and V for one page of one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(FullAttentionSpec):
    """Pages for chunked-local layers only (hybrid mode)."""

    attention_chunk_size: int | None = None
    has_global_layers: bool = False

    def __post_init__(self):
        if self.attention_chunk_size is None:
            raise ValueError("ChunkedLocalAttentionSpec needs attention_chunk_size")
        super().__post_init__()


def chunk_size_of(spec) -> int | None:
    """The chunk size a spec asks for, or None for plain causal attention.

    Duck-typed on purpose: a FullAttentionSpec that carries a chunk size (what a
    merged group looks like) counts as chunked, which an isinstance check on
    ChunkedLocalAttentionSpec would miss.
    """
    chunk = getattr(spec, "attention_chunk_size", None)
    return int(chunk) if chunk else None


def needs_global_pages(spec) -> bool:
    """Whether some layer reading this spec attends over the whole sequence.

    A chunked spec that does not say (a duck-typed spec without
    ``has_global_layers``) is assumed to be read by global layers too: sizing
    pages for whole sequences is safe, sizing them for one chunk is the
    under-allocation vLLM PR 50022 warns about (2250 -> 512 pages).
    """
    return chunk_size_of(spec) is None or bool(getattr(spec, "has_global_layers", True))


def attention_kinds(spec) -> tuple[Kind, ...]:
    """Which layer kinds read this spec: (CHUNKED,), (GLOBAL,), or both (a merged group)."""
    chunked = (Kind.CHUNKED,) if chunk_size_of(spec) else ()
    return chunked + ((Kind.GLOBAL,) if needs_global_pages(spec) else ())


def merge(specs) -> FullAttentionSpec:
    """Merge the specs of the layers of one KV-cache group into one spec.

    Geometry (block_size, num_kv_heads, head_dim, dtype, sliding_window) must
    agree, and so must the chunk size of every chunked layer.  The result keeps
    the chunk size and records whether global layers share the group.
    """
    specs = list(specs)
    if not specs:
        raise ValueError("merge() needs at least one spec")
    first = specs[0]
    geometry = ("block_size", "num_kv_heads", "head_dim", "dtype", "sliding_window")
    for i, spec in enumerate(specs[1:], start=1):
        for name in geometry:
            if getattr(spec, name) != getattr(first, name):
                raise ValueError(
                    f"cannot merge spec {i}: {name}={getattr(spec, name)!r} differs from "
                    f"spec 0's {getattr(first, name)!r}"
                )
    chunks = {chunk_size_of(s) for s in specs} - {None}
    if len(chunks) > 1:
        raise ValueError(f"cannot merge specs with different chunk sizes: {sorted(chunks)}")
    chunk = chunks.pop() if chunks else None
    has_global = any(needs_global_pages(s) for s in specs)
    if chunk is not None and not has_global:
        return ChunkedLocalAttentionSpec(
            first.block_size, first.num_kv_heads, first.head_dim, first.dtype,
            attention_chunk_size=chunk, sliding_window=first.sliding_window,
        )
    base = FullAttentionSpec(
        first.block_size, first.num_kv_heads, first.head_dim, first.dtype,
        sliding_window=first.sliding_window,
    )
    return replace(base, attention_chunk_size=chunk, has_global_layers=has_global)
