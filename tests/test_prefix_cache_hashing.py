"""Block hashes of the prefix cache (engine/prefix_cache.py): chained, salted, both algorithms
("builtin", "sha256"), extended piecewise as at once, and the same hits either way."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_prefix_cache import check_idle
from test_prefix_cache_accounting import drive, make_scheduler

from chunklocal.engine.block_manager import BlockManager
from chunklocal.engine.prefix_cache import HASH_ALGOS, extend_hashes, salt_key

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
TOKENS = st.lists(st.integers(0, 202_047), min_size=8, max_size=64)


@settings(max_examples=60, deadline=None)
@given(tokens=TOKENS, bs=st.sampled_from([1, 2, 4]), algo=st.sampled_from(HASH_ALGOS),
       at=st.integers(0, 63), salt=st.sampled_from([None, "a", "b"]), cut=st.integers(0, 16))
def test_a_block_hash_names_its_whole_prefix_and_salt(tokens, bs, algo, at, salt, cut):
    nb = len(tokens) // bs
    extra = salt_key(salt)
    hashes = extend_hashes([], tokens, bs, nb, extra, algo)
    assert len(hashes) == nb and len(set(hashes)) == nb  # no two prefixes alike here
    assert extend_hashes(extend_hashes([], tokens, bs, min(cut, nb), extra, algo), tokens,
                         bs, nb, extra, algo) == hashes  # piecewise: the same chain
    assert extend_hashes([], tokens + [7] * bs, bs, nb, extra, algo) == hashes  # only its own
    at %= len(tokens)
    changed = tokens[:at] + [tokens[at] ^ 1] + tokens[at + 1:]
    other = extend_hashes([], changed, bs, nb, extra, algo)
    first = at // bs  # blocks before the change keep their hash, every later one changes
    assert other[:first] == hashes[:first]
    assert all(a != b for a, b in zip(other[first:], hashes[first:], strict=True))
    salted = extend_hashes([], tokens, bs, nb, salt_key("c"), algo)
    assert all(a != b for a, b in zip(salted, hashes, strict=True))
    swapped = tokens[bs:2 * bs] + tokens[:bs] + tokens[2 * bs:]
    if nb >= 2 and swapped[:2 * bs] != tokens[:2 * bs]:  # blocks in another order: a new chain
        assert extend_hashes([], swapped, bs, nb, extra, algo)[1:] != hashes[1:]


def test_algorithms_differ_and_a_bad_one_is_refused():
    tokens = list(range(64))
    builtin, sha = (extend_hashes([], tokens, 4, 16, 0, algo) for algo in HASH_ALGOS)
    assert builtin != sha and all(h.bit_length() > 64 for h in sha[:4])
    with pytest.raises(ValueError, match="prefix_caching_hash_algo.*'md5'"):
        extend_hashes([], tokens, 4, 16, 0, "md5")
    with pytest.raises(ValueError, match="prefix_caching_hash_algo.*'md5'"):
        BlockManager([], 1, 1, prefix_caching=True, hash_algo="md5")


def test_hits_and_outputs_the_same_with_either_algorithm():
    base = [(3 * i + i // 7) % 5 for i in range(40)]
    prompts = [base[:n] + [n % 5] for n in (9, 16, 17, 31, 40)] * 2
    hits = {}
    for algo in HASH_ALGOS:
        scheduler = make_scheduler(4, 8, (60, 30), 3, 24, max_len=64)
        scheduler.block_manager.hash_algo = algo
        drive(scheduler, prompts, 4)  # outputs checked against the fake model's
        check_idle(scheduler.block_manager)
        hits[algo] = scheduler.block_manager.prefix_cache_hits
    assert len(set(hits.values())) == 1 and min(hits.values()) > 0


def test_llm_and_serve_take_the_hash_algorithm(tmp_path):
    """``LLM(prefix_caching_hash_algo=...)`` (vLLM's argument; ``--prefix-caching-hash-algo``
    on the server) reaches the block manager; a bad value is refused before loading."""
    import argparse

    import numpy as np
    from llama4_tiny import write_tiny_llama4

    import chunklocal
    from chunklocal.engine.sampling import SamplingParams
    from chunklocal.server import cli as serve_cli

    write_tiny_llama4(tmp_path, seed=1, attention_chunk_size=16)
    prompt = np.random.default_rng(4).integers(1, 512, 50).tolist()
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    outs = {}
    for algo in HASH_ALGOS:
        llm = chunklocal.LLM(tmp_path, block_size=8, max_model_len=96,
                             prefix_caching_hash_algo=algo)
        assert llm.block_manager.hash_algo == algo
        first, second = (llm.generate([prompt], greedy, use_tqdm=False)[0] for _ in range(2))
        assert second.num_cached_tokens == 48
        outs[algo] = second.outputs[0].token_ids
    assert outs["builtin"] == outs["sha256"]
    with pytest.raises(ValueError, match="prefix_caching_hash_algo must be one of"):
        chunklocal.LLM(tmp_path, prefix_caching_hash_algo="md5")
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args([str(tmp_path), "--prefix-caching-hash-algo", "sha256"])
    assert serve_cli.llm_kwargs(args)["prefix_caching_hash_algo"] == "sha256"
