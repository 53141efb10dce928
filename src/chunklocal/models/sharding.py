"""Which Llama-4 shapes a tensor-parallel size can split, and each rank's weight slices.

:func:`check_tensor_parallel` runs on the config before any weight is read: every
size the scheme splits must divide by the tensor-parallel size N, else ValueError
naming the field.  :func:`kv_head_split` says how the KV heads are spread: N <=
num_key_value_heads splits them (each rank num_key_value_heads / N heads); N >
num_key_value_heads replicates each KV head on N / num_key_value_heads ranks, the
ones whose query heads read it.  :func:`shard_rules` collects the modules'
:class:`~chunklocal.models.parallel.ShardRule` by full parameter name.
"""

from __future__ import annotations

from torch import nn

from chunklocal._validate import as_int
from chunklocal.models.parallel import ShardRule

MOE_PARALLEL = ("tp", "ep")


def kv_head_split(num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(KV heads per rank, ranks holding each KV head)."""
    if tp_size <= num_kv_heads:
        return num_kv_heads // tp_size, 1
    return 1, tp_size // num_kv_heads


def check_tensor_parallel(config, tensor_parallel_size, moe_parallel="tp") -> int:
    """The tensor-parallel size as an int, or ValueError naming the first size it cannot split."""
    if as_int(tensor_parallel_size, "tensor_parallel_size") < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size!r}")
    if moe_parallel not in MOE_PARALLEL:
        raise ValueError(f"moe_parallel must be 'tp' or 'ep', got {moe_parallel!r}")
    n = int(tensor_parallel_size)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    moe_layers = set(getattr(config, "moe_layers", None) or ())
    has_moe = bool(moe_layers)
    has_dense = len(moe_layers) < config.num_hidden_layers
    splits = [("num_attention_heads", heads), ("vocab_size", config.vocab_size)]
    if has_dense:
        splits.append(("intermediate_size_mlp", config.intermediate_size_mlp))
    if has_moe:
        # The shared expert is split by its inner size in both schemes; the routed
        # experts by their inner size ("tp") or by whole experts ("ep").
        splits.append(("intermediate_size", config.intermediate_size))
        if moe_parallel == "ep":
            splits.append(("num_local_experts", config.num_local_experts))
    for name, value in splits:
        if value % n:
            raise ValueError(f"tensor_parallel_size {n} does not divide {name} = {value}")
    if n <= kv_heads and kv_heads % n:
        raise ValueError(f"tensor_parallel_size {n} does not divide num_key_value_heads = "
                         f"{kv_heads} (and is not a multiple of it, which would replicate them)")
    if n > kv_heads and n % kv_heads:
        raise ValueError(f"tensor_parallel_size {n} > num_key_value_heads = {kv_heads} must be "
                         "a multiple of it (each KV head is then replicated on N / that ranks)")
    return n


def shard_rules(model: nn.Module) -> dict[str, ShardRule]:
    """``{parameter name: rule}`` of every sharded parameter; the others are replicated."""
    rules = {}
    for prefix, module in model.named_modules():
        for name, rule in getattr(module, "shard_rules", {}).items():
            rules[f"{prefix}.{name}" if prefix else name] = rule
    return rules


def local_pieces(rule, full_shape, index=()):
    """Where a piece of a full tensor lands in this rank's slice.

    The piece is ``full[index]`` (``index``: ints and slices over the leading dims, as a
    loader route gives it); returns ``[(piece_selection, local_selection)]``: copy
    ``piece[piece_selection]`` into ``local[local_selection]`` for each pair (none when
    the piece holds nothing of this rank's slice).  ``rule``: a ShardRule, or None
    (replicated: the piece lands whole, at ``index``).
    """
    entries = list(index) + [slice(None)] * (len(full_shape) - len(index))
    piece_dims = sum(not isinstance(e, int) for e in entries)
    whole = tuple([slice(None)] * piece_dims)
    if rule is None or rule.num_shards == 1:
        return [(whole, tuple(entries))]
    d = rule.dim
    block = full_shape[d] // rule.parts
    step = block // rule.num_shards
    # this rank's runs of the full dimension: (full start, full end, local start)
    runs = [(p * block + rule.index * step, p * block + (rule.index + 1) * step, p * step)
            for p in range(rule.parts)]
    e, out = entries[d], []
    if isinstance(e, int):
        for a, b, local in runs:
            if a <= e < b:
                out.append((whole, tuple(entries[:d] + [local + e - a] + entries[d + 1:])))
        return out
    start, stop, stride = e.indices(full_shape[d])
    if stride != 1:
        raise ValueError(f"a strided piece {e} of a sharded tensor")
    piece_dim = sum(not isinstance(x, int) for x in entries[:d])
    for a, b, local in runs:
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            src = list(whole)
            src[piece_dim] = slice(lo - start, hi - start)
            dst = entries[:d] + [slice(local + lo - a, local + hi - a)] + entries[d + 1:]
            out.append((tuple(src), tuple(dst)))
    return out
