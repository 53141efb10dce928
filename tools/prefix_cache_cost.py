"""Host cost of a prefix-cache lookup per request (engine/prefix_cache.py).

    python tools/prefix_cache_cost.py [--tokens 4096] [--block-size 16] [--chunk 8192]

Builds a hybrid block manager (a global and a chunked group) whose cache holds one
prompt, then times, per request of the same prompt: hashing its full blocks (once per
request, shared by its n samples) and the lookup (``BlockManager.lookup``: the global
run, the chunk window, the hit's tables).
"""

from __future__ import annotations

import argparse
import timeit

import torch

from chunklocal.engine.block_manager import BlockManager, KVGroup
from chunklocal.engine.prefix_cache import extend_hashes
from chunklocal.engine.sampling import SamplingParams
from chunklocal.engine.sequence import Sequence
from chunklocal.kv_spec import ChunkedLocalAttentionSpec, FullAttentionSpec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=8192)
    args = parser.parse_args()
    bs, n = args.block_size, args.tokens
    geometry = (bs, 1, 8, torch.float32)
    pages = n // bs + 8
    groups = [KVGroup(FullAttentionSpec(*geometry), pages),
              KVGroup(ChunkedLocalAttentionSpec(*geometry, attention_chunk_size=args.chunk),
                      pages)]
    manager = BlockManager(groups, 4, pages, prefix_caching=True)
    prompt = [(i * 7919) % 200_000 for i in range(n + 1)]
    params = SamplingParams(max_tokens=1)
    first = Sequence(0, prompt, params, 2)
    manager.allocate(first, len(prompt))  # registers every full prompt block
    manager.free(first)  # evictable, still cached
    reps = 2000
    hashing = timeit.timeit(lambda: extend_hashes([], prompt, bs, len(prompt) // bs),
                            number=reps) / reps
    seq = Sequence(1, prompt, params, 2)
    manager.lookup(seq)  # hashes now on seq: time the lookup alone
    lookup = timeit.timeit(lambda: manager.lookup(seq), number=reps) / reps
    hit = manager.lookup(seq)
    print(f"{n}-token prompt, block {bs}, chunk {args.chunk}: hashing {len(prompt) // bs} "
          f"blocks {hashing * 1e6:.0f} us, lookup {lookup * 1e6:.0f} us "
          f"(hit {hit.num_tokens if hit else 0} tokens), total {(hashing + lookup) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
