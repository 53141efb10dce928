"""`chunklocal plan` and `chunklocal demo` (stage 1)."""

from __future__ import annotations

import argparse
import json
from functools import partial

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import dense_chunked_attention

from chunklocal import cli, make_virtual_batches
from chunklocal.cli import demo
from chunklocal.cli import plan as sizing
from chunklocal.reference import reference_attention

REPORTER = ["--max-num-seqs", "1", "--max-num-batched-tokens", "36000", "--max-model-len",
            "36000", "--chunk-size", "8192", "--block-size", "16"]


def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_plan_json_on_reporters_config(capsys):
    rc, out, _ = run_cli(capsys, "plan", *REPORTER, "--json")
    assert rc == 0
    result = json.loads(out)
    assert result["virtual_batches"]["ours"] == 5
    buffers = {row["buffer"]: row for row in result["buffers"]}
    indptr = buffers["paged_kv_indptr"]
    # Numbers from vLLM PR 50022's table: indptr 2 -> 8, indices 2250 -> 3584.
    assert (indptr["max_num_seqs_sized"], indptr["published"], indptr["ours"]) == (2, 8, 6)
    assert indptr["overflows"] and buffers["paged_kv_last_page_len"]["overflows"]
    assert buffers["qo_indptr"]["ours"] == 6
    indices = buffers["paged_kv_indices"]
    assert (indices["max_num_seqs_sized"], indices["published"]) == (2250, 3584)
    # The 36000-token request's local pages are exactly cdiv(36000, 16).
    assert indices["ours"] == 2250 and not indices["overflows"]


def test_plan_sizes_cover_the_reporters_actual_batch():
    seq = 36000
    vb = make_virtual_batches([0, seq], [seq], np.arange(2250)[None], 8192, 16)
    rows = {r.buffer: r for r in sizing.buffer_rows(1, 36000, 36000, 8192, 16)}
    assert rows["paged_kv_indptr"].max_num_seqs_sized < vb.num_batches + 1
    assert rows["paged_kv_indptr"].ours >= vb.num_batches + 1
    assert rows["paged_kv_last_page_len"].ours >= vb.num_batches
    assert rows["paged_kv_indices"].ours >= int((-(-vb.seq_lens // 16)).sum())


def test_plan_second_published_config():
    # PR 50022: max_model_len=131072, T=8192, N=256, c=8192, bs=16: indptr 257 -> 514,
    # indices unchanged.
    result = sizing.plan(256, 8192, 131072, 8192, 16)
    buffers = {row["buffer"]: row for row in result["buffers"]}
    assert buffers["paged_kv_indptr"]["max_num_seqs_sized"] == 257
    assert buffers["paged_kv_indptr"]["published"] == 514
    indices = buffers["paged_kv_indices"]
    assert indices["published"] == indices["max_num_seqs_sized"] == 256 * 8192


def test_plan_text_table(capsys):
    rc, out, _ = run_cli(capsys, "plan", *REPORTER)
    assert rc == 0
    lines = out.splitlines()
    assert "published bound 7, ours 5" in out
    row = next(line for line in lines if line.startswith("paged_kv_indptr"))
    assert row.split() == ["paged_kv_indptr", "2", "8", "6", "YES"]
    row = next(line for line in lines if line.startswith("paged_kv_indices"))
    assert row.split() == ["paged_kv_indices", "2250", "3584", "2250", "no"]


def test_plan_defaults_to_reporters_config(capsys):
    assert run_cli(capsys, "plan")[1] == run_cli(capsys, "plan", *REPORTER)[1]


def test_plan_rejects_bad_config(capsys):
    rc, _, err = run_cli(capsys, "plan", "--chunk-size", "100")
    assert rc == 2 and "chunk_size 100 is not a multiple of block_size 16" in err
    with pytest.raises(SystemExit):
        cli.main(["plan", "--max-num-seqs", "0"])


def test_demo_stage1_on_the_reporters_scenario(capsys):
    """Stage 1 of `chunklocal demo` on the full default scenario, through the same
    functions its main() calls (about 5-10 s on 2 cores).  The whole-CLI run, with the
    model stages, is tested with those stages."""
    cfg = sizing.REPORTER_CONFIG
    sc = demo.reporter_scenario()
    assert demo.run_attention_demo(sc) < demo.TOLERANCE
    result = demo.print_sizing()
    vb = make_virtual_batches(sc.query_start_loc, sc.seq_lens, sc.block_table,
                              sc.chunk_size, cfg["block_size"])
    demo.show_overflow(vb.seq_lens, cfg["max_num_seqs"], cfg["block_size"],
                       result["virtual_batches"]["ours"])
    out = capsys.readouterr().out
    assert "-> 5 virtual batches" in out
    assert ("expected failure (the bug of vLLM issue 49980): max_num_seqs-sized "
            "paged_kv_indptr (2 entries) for 5 virtual batches -> ValueError: provided out is "
            "the wrong size for the accumulation") in out
    assert "published bound: what vLLM PR 50022 allocates" in out
    assert "our paged_kv_indptr (6 entries): [0, 512, 1024, 1536, 2048, 2250]" in out
    assert "(OK, tolerance 1e-05)" in out


def small_scenario():
    return demo.reporter_scenario(seq_len=700, chunk_size=256, block_size=16, num_q_heads=4,
                                  num_kv_heads=1, head_dim=16, seed=3)


def test_demo_oracle_agrees_with_test_oracle():
    sc = small_scenario()
    rows = demo.sample_rows(700, 256, 20)
    assert {255, 256, 257, 511, 512, 513, 0, 699} <= set(rows.tolist())
    want = dense_chunked_attention(sc.q, sc.k_cache, sc.v_cache, sc.query_start_loc,
                                   sc.seq_lens, sc.block_table, 256)[rows]
    torch.testing.assert_close(demo.dense_oracle_rows(sc, rows), want, atol=1e-12, rtol=0)


def test_demo_check_catches_a_wrong_attention(monkeypatch, capsys):
    sc = small_scenario()
    assert demo.run_attention_demo(sc) < demo.TOLERANCE
    # Plain causal attention instead of chunked: the check must fail.
    monkeypatch.setattr(demo, "reference_attention",
                        partial(lambda *a, chunk_size: reference_attention(*a)))
    assert demo.run_attention_demo(sc) > demo.TOLERANCE
    assert "FAIL" in capsys.readouterr().out


@st.composite
def limits_and_batch(draw):
    block = draw(st.sampled_from([1, 2, 4]))
    chunk = block * draw(st.integers(1, 4))
    n_max = draw(st.integers(1, 4))
    tokens = draw(st.integers(1, 40))
    model_len = draw(st.integers(1, 40))
    n = draw(st.integers(1, n_max))
    query, seq = [], []
    budget = tokens
    for _ in range(n):
        if budget == 0:
            break
        q = draw(st.integers(1, min(budget, model_len)))
        s = draw(st.integers(q, model_len))
        budget -= q
        query.append(q)
        seq.append(s)
    return (n_max, tokens, model_len, chunk, block), query, seq


@settings(max_examples=300, deadline=None)
@given(limits_and_batch())
def test_plan_sizes_hold_every_allowed_batch(case):
    (n_max, tokens, model_len, chunk, block), query, seq = case
    rows = {r.buffer: r for r in sizing.buffer_rows(n_max, tokens, model_len, chunk, block)}
    width = -(-max(seq) // block)
    table = np.arange(len(seq) * width).reshape(len(seq), width)
    qsl = np.concatenate([[0], np.cumsum(query)])
    vb = make_virtual_batches(qsl, seq, table, chunk, block)
    pages = int((-(-vb.seq_lens.astype(np.int64) // block)).sum())
    assert rows["qo_indptr"].ours >= vb.num_batches + 1
    assert rows["paged_kv_indptr"].ours >= vb.num_batches + 1
    assert rows["paged_kv_last_page_len"].ours >= vb.num_batches
    assert rows["paged_kv_indices"].ours >= pages
    assert rows["paged_kv_indptr"].published >= rows["paged_kv_indptr"].ours


def test_plan_merged_group_keeps_whole_sequence_pages():
    # 256 decodes each at max_model_len: the global layers of a merged group read
    # every page of every request, 256 * 131072 / 16 pages, far above the local need.
    rows = {r.buffer: r for r in sizing.buffer_rows(256, 8192, 131072, 8192, 16)}
    assert rows["paged_kv_indices (merged)"].ours == 256 * 131072 // 16
    assert rows["paged_kv_indices"].ours < rows["paged_kv_indices (merged)"].ours


@pytest.fixture
def no_demo_work(monkeypatch):
    """`chunklocal demo` must reject bad arguments before any stage runs."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("a demo stage ran despite bad arguments")

    for name in ("main", "reporter_scenario", "run_attention_demo"):
        monkeypatch.setattr(demo, name, must_not_run)


@pytest.mark.parametrize("option", ["--new-tokens", "--prompt-len", "--num-q-heads",
                                    "--num-kv-heads", "--head-dim"])
@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_demo_rejects_non_positive_ints_before_work(no_demo_work, capsys, option, value):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", option, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: must be a positive integer, got" in err and value in err


def test_demo_rejects_heads_not_a_multiple_before_work(no_demo_work, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--num-q-heads", "3", "--num-kv-heads", "2"])
    assert exc.value.code == 2
    assert "argument --num-q-heads: 3 is not a multiple of --num-kv-heads 2" in \
        capsys.readouterr().err


@pytest.mark.parametrize("make", ["missing", "file", "empty_dir"])
def test_demo_rejects_a_bad_model_dir_before_work(no_demo_work, capsys, tmp_path, make):
    path = tmp_path / "model"
    if make == "file":
        path.write_text("not a checkpoint")
    elif make == "empty_dir":
        path.mkdir()
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--model", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --model:" in err and str(path) in err and "config.json" in err


def test_demo_rejects_a_bad_device_before_work(no_demo_work, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--device", "gpu"])
    assert exc.value.code == 2
    assert "argument --device: must be cpu or cuda" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:
            cli.main(["demo", "--device", "cuda"])
        assert exc.value.code == 2
        assert "argument --device: 'cuda' but CUDA is not available" in capsys.readouterr().err


def test_demo_passes_valid_arguments_through(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    seen = {}
    monkeypatch.setattr(demo, "main", lambda args: seen.update(vars(args)) or 0)
    argv = ["demo", "--model", str(tmp_path), "--prompt-len", "100", "--new-tokens", "2",
            "--num-q-heads", "8", "--num-kv-heads", "2", "--head-dim", "16", "--seed", "-1"]
    assert cli.main(argv) == 0
    assert (seen["model"], seen["prompt_len"], seen["new_tokens"], seen["num_q_heads"],
            seen["num_kv_heads"], seen["head_dim"], seen["seed"], seen["device"]) == \
        (str(tmp_path), 100, 2, 8, 2, 16, -1, "cpu")
    assert cli.main(["demo"]) == 0
    assert (seen["model"], seen["prompt_len"], seen["new_tokens"], seen["device"]) == \
        (None, 36000, 32, "cpu")


@pytest.mark.parametrize("args, message", [
    (["--max-n", "0"], "argument --max-n: must be a positive integer, got 0"),
    (["--max-t", "-1"], "argument --max-t: must be a positive integer, got -1"),
    (["--workers", "two"], "argument --workers: must be a positive integer, got 'two'"),
    (["--chunks", "4-2"], "argument --chunks: bad range '4-2'"),
    (["--lens", "x"], "argument --lens: cannot read 'x'"),
    (["--plot", "/nonexistent-dir/bounds.png"], "argument --plot: folder of"),
    (["--chunks", ""], "argument --chunks: empty: want '1-16' or '1,2,4'"),
    (["--plot", "x.txt"], "argument --plot: 'x.txt' is not an image format matplotlib writes"),
])
def test_verify_bounds_rejects_bad_arguments_before_the_sweep(monkeypatch, capsys, args,
                                                              message):
    from chunklocal.bounds import verify as verify_bounds

    monkeypatch.setattr(verify_bounds, "sweep", lambda *a, **k: pytest.fail("sweep ran"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["verify-bounds", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_prints_what_the_backend_allocates_with_graph_room(capsys):
    """Verify graphs give every request two slots: with T = N the graph layout, not the step
    bound, decides the indptr length, and plan must print that (2 * 8 + 1 = 17)."""
    from chunklocal.backends.base import EngineLimits
    from chunklocal.backends.flashinfer.buffers import MetadataBuffers
    from chunklocal.bounds.sizing import backend_capacities
    from chunklocal.kv_spec import ChunkedLocalAttentionSpec, Kind

    args = ["--max-num-seqs", "8", "--max-num-batched-tokens", "8", "--max-model-len", "36000",
            "--num-speculative-tokens", "3"]
    rows = {r["buffer"]: r for r in json.loads(run_cli(capsys, "plan", *args, "--json")[1])
            ["buffers"]}
    eager = {r["buffer"]: r for r in json.loads(
        run_cli(capsys, "plan", *args, "--no-cuda-graphs", "--json")[1])["buffers"]}
    assert eager["paged_kv_indptr"]["ours"] == 9  # 8 requests, one virtual batch each
    assert rows["paged_kv_indptr"]["ours"] == 17
    # The backend's own allocation, made from the same call, has exactly these lengths.
    spec = ChunkedLocalAttentionSpec(16, 8, 128, torch.bfloat16, attention_chunk_size=8192)
    sizes = backend_capacities(spec, EngineLimits(8, 8, 36000, 16), True, 4)
    buffers = MetadataBuffers(sizes.capacities[Kind.CHUNKED], 16, verify_rows=sizes.verify_rows)
    for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_last_page_len", "paged_kv_indices"):
        assert buffers.gpu[name].shape[0] == rows[name]["ours"], name
    out = run_cli(capsys, "plan", *args)[1]
    assert "CUDA graphs: batch sizes 1, 2, 4, 8, query lengths 1, 4" in out


def test_version(capsys):
    from chunklocal import __version__

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"chunklocal {__version__}"


@pytest.mark.parametrize("model_config, argv, limit", [
    (None, ["--prompt-len", "65505"], 65536),                      # 65505 + 32 new tokens
    ({"max_position_embeddings": 4096}, ["--prompt-len", "4000", "--new-tokens", "97"], 4096),
    ({"text_config": {"max_position_embeddings": 512}}, ["--prompt-len", "512"], 512),
])
def test_demo_rejects_a_prompt_past_the_models_maximum(no_demo_work, capsys, tmp_path,
                                                        model_config, argv, limit):
    if model_config is not None:
        (tmp_path / "config.json").write_text(json.dumps(model_config))
        argv = ["--model", str(tmp_path), *argv]
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", *argv])
    assert exc.value.code == 2
    assert f"exceed the model's max_position_embeddings {limit}" in capsys.readouterr().err


def test_demo_prompt_at_the_models_maximum_is_accepted(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    monkeypatch.setattr(demo, "main", lambda args: 0)
    assert cli.main(["demo", "--model", str(tmp_path), "--prompt-len", "4064"]) == 0


@pytest.mark.parametrize("engine_ok", [True, False])
def test_demo_ends_with_one_pass_or_fail_line(monkeypatch, capsys, engine_ok):
    scenario = small_scenario()
    monkeypatch.setattr(demo, "reporter_scenario", lambda **kwargs: scenario)
    monkeypatch.setattr(demo, "run_engine_demo", lambda *args, **kwargs: engine_ok)
    args = argparse.Namespace(num_q_heads=4, num_kv_heads=1, head_dim=16, seed=0, model=None,
                              device="cpu", prompt_len=10, new_tokens=2,
                              check_transformers=None)
    assert demo.main(args) == (0 if engine_ok else 1)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("PASS: " if engine_ok else "FAIL: engine runs")


def test_plan_into_a_closed_pipe_is_quiet(tmp_path):
    """`chunklocal plan ... | head -1`: the reader leaves early; no traceback."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    proc = subprocess.run(
        [sys.executable, "-c", "from chunklocal.cli import main; raise SystemExit(main())",
         "plan", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len",
         "256", "--chunk-size", "32", "--block-size", "16"],
        stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write_end)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0


def test_plan_prints_the_kv_pools_of_a_budget(capsys):
    rc, out, _ = run_cli(capsys, "plan", "--max-num-seqs", "8", "--max-num-batched-tokens",
                         "8192", "--max-model-len", "131072", "--kv-memory-gib", "40")
    assert rc == 0
    assert "KV pools (hybrid; layers: 36 chunked, 12 global; 65536 bytes per page" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("chunked ", "global "))}
    # chunked: 8 x cdiv(8191 + 8192, 16) pages (its cap); the global pool takes the rest of
    # the 40 GiB: (40 GiB - 8193 x 36 x 64 KiB - 12 x 64 KiB) / (12 x 64 KiB) = 30033 pages,
    # not the 13653 of an equal split that left 12 GiB unallocated.
    assert rows["global"][1:4] == ["12", "30033", "8192"]
    assert rows["chunked"][1:4] == ["36", "8192", "1024"]
    assert "that fit at once: 3" in out


def test_plan_kv_pools_json_and_refusal(capsys):
    rc, out, _ = run_cli(capsys, "plan", *REPORTER, "--num-kv-blocks", "9000",
                         "--no-hybrid-kv-cache", "--json")
    assert rc == 0
    pools = json.loads(out)["kv_pools"]
    assert [(g["name"], g["pages"], g["need"], g["requests_fit"]) for g in pools["groups"]] \
        == [("merged", 9000, 2250, 4)]
    rc, _, err = run_cli(capsys, "plan", *REPORTER, "--num-kv-blocks", "100")
    assert rc == 2 and "pass num_kv_blocks >= 2250" in err
