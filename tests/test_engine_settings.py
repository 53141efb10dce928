"""EngineConfig (engine/config.py): one frozen, checked set of settings that ``LLM``,
``chunklocal serve`` and ``chunklocal plan`` all build, so they cannot disagree; and the
memory-budget flags of serve and plan."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json

import numpy as np
import pytest
import test_engine_memory as tm
import torch
from llama4_tiny import write_tiny_llama4
from test_engine_memory import fake  # noqa: F401  (the fake device memory fixture)

import chunklocal
from chunklocal import cli
from chunklocal.bounds.kv_pools import GIB
from chunklocal.cli import plan_pools
from chunklocal.engine.config import EngineConfig
from chunklocal.models.llama4_config import read_config
from chunklocal.server import cli as serve_cli


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4_settings")
    write_tiny_llama4(path, seed=0)
    return path


def test_fields_and_defaults_are_llms():
    params = {name: p.default for name, p in inspect.signature(chunklocal.LLM.__init__)
              .parameters.items() if name not in ("self", "model")}
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert list(fields) == list(params)
    defaults = dict(fields, device="cpu")  # normalised to torch.device("cpu")
    assert defaults == params
    assert EngineConfig().device == torch.device("cpu")


def test_frozen_and_normalised():
    cfg = EngineConfig(dtype="bfloat16", max_num_seqs=np.int64(4), cuda_graphs=np.bool_(False),
                       kv_cache_dtype="fp8_e4m3", gpu_memory_utilization=1)
    assert (cfg.dtype, cfg.max_num_seqs, cfg.cuda_graphs, cfg.kv_cache_dtype) == \
        (torch.bfloat16, 4, False, "fp8")
    assert type(cfg.max_num_seqs) is int and cfg.gpu_memory_utilization == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_num_seqs = 8  # type: ignore[misc]
    assert dataclasses.replace(cfg, max_num_seqs=8).max_num_seqs == 8


@pytest.mark.parametrize("name, value, message", [
    ("max_num_seqs", 0, "max_num_seqs must be positive, got 0"),
    ("block_size", 4.5, "block_size"),
    ("gpu_memory_utilization", 0, r"gpu_memory_utilization must be a fraction in \(0, 1\]"),
    ("gpu_memory_utilization", 1.2, "got 1.2"),
    ("kv_cache_dtype", "int8", "kv_cache_dtype must be one of"),
    ("hybrid_kv_cache", "yes", "hybrid_kv_cache must be True or False, got 'yes'"),
])
def test_each_setting_is_checked_on_construction_and_by_llm(path, name, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{name: value})
    with pytest.raises(ValueError, match=message):
        chunklocal.LLM(path, max_model_len=128, **{name: value})


def test_for_model_resolves_and_checks_against_the_checkpoint(path):
    text = read_config(path).text
    assert EngineConfig().for_model(text).max_model_len == text.max_position_embeddings
    assert EngineConfig(max_model_len=100).for_model(text).max_model_len == 100
    with pytest.raises(ValueError, match="max_model_len 5000 exceeds the config's "
                                         "max_position_embeddings"):
        EngineConfig(max_model_len=5000).for_model(text)
    with pytest.raises(ValueError, match="chunk"):
        EngineConfig(block_size=64).for_model(text)  # c = 32 is no whole number of pages


def test_llm_and_serve_build_the_same_config(path):
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args([str(path), "--device", "cpu", "--max-model-len", "128",
                              "--gpu-memory-utilization", "0.5", "--max-num-seqs", "4"])
    kwargs = serve_cli.llm_kwargs(args)
    assert kwargs["gpu_memory_utilization"] == 0.5
    llm = chunklocal.LLM(path, **kwargs)
    assert isinstance(llm.engine_config, EngineConfig)
    assert llm.engine_config == EngineConfig(**kwargs).for_model(llm.config)
    assert llm.gpu_memory_utilization == 0.5 and llm.max_num_seqs == 4


def test_serve_refuses_a_fraction_outside_0_1_before_loading(path, caplog):
    rc = cli.main(["serve", str(path), "--device", "cpu", "--max-model-len", "128",
                   "--gpu-memory-utilization", "1.5", "--port", "65531"])
    assert rc == 1
    assert "gpu_memory_utilization must be a fraction in (0, 1]" in caplog.text
    assert "got 1.5" in caplog.text


def run_plan(capsys, *argv):
    rc = cli.main(["plan", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


SCOUT_1M = ["--max-num-seqs", "1", "--max-num-batched-tokens", "8192", "--max-model-len",
            "1048832", "--chunk-size", "8192", "--device-memory-gib", "139.8",
            "--weights-gib", "105.2", "--activations-gib", "3"]


def test_plan_a_gpu_memory_utilization_budget(capsys):
    """Full-size Scout FP8 on one H200: a 1M-token request needs 25.1 GiB of FP8 KV, more
    than vLLM's default 0.9 leaves after 105.2 GiB of weights and 3 GiB of activations;
    0.97 holds it."""
    rc, _, err = run_plan(capsys, *SCOUT_1M, "--kv-cache-dtype", "fp8")
    assert rc == 2 and "needs 25.1 GiB of KV cache, more than the default budget of 17.5 " \
        "GiB (gpu_memory_utilization=0.9 of 139.8 GiB" in err  # 0.14 GiB of headroom kept
    rc, out, _ = run_plan(capsys, *SCOUT_1M, "--kv-cache-dtype", "fp8",
                          "--gpu-memory-utilization", "0.97", "--json")
    assert rc == 0
    pools = json.loads(out)["kv_pools"]
    budget = pools["budget"]
    assert budget["requested_bytes"] == int(0.97 * int(139.8 * GIB))
    assert pools["requests_fit"] == 1
    assert pools["one_request"]["pages"] == {"chunked": 1024, "global": 65552}
    assert pools["total_bytes"] <= budget["requested_bytes"] - budget["weight_bytes"] \
        - budget["activation_bytes"] - budget["headroom_bytes"]
    assert budget["headroom_bytes"] == int(int(139.8 * GIB) / 1024)
    # bf16 pages: twice the bytes a request needs; the table says so.
    rc, out, _ = run_plan(capsys, *SCOUT_1M, "--gpu-memory-utilization", "1", "--weights-gib",
                          "50")
    assert rc == 0 and "budget: gpu_memory_utilization 1.0 of 139.8 GiB" in out
    assert "one request of max_model_len 1048832 needs 50.26 GiB of KV" in out


@pytest.mark.parametrize("argv, message", [
    (["--gpu-memory-utilization", "0", "--device-memory-gib", "80"],
     r"gpu_memory_utilization must be a fraction in (0, 1] of the device's total memory, "
     r"got 0.0"),
    (["--device-memory-gib", "-1"], "device_memory_gib must be positive, got -1.0"),
    (["--device-memory-gib", "80", "--weights-gib", "-2"], "weights_gib must be >= 0"),
])
def test_plan_refusals_are_llms(capsys, argv, message):
    rc, _, err = run_plan(capsys, *argv)
    assert rc == 2 and message in err, err


def test_plan_kv_cache_dtype_fp8_halves_the_pages():
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=4096, chunk_size=128,
              block_size=16, kv_memory_gib=1.0)
    bf16, fp8 = plan_pools.kv_pools(**kw), plan_pools.kv_pools(**kw, kv_dtype_bytes=1)
    assert fp8["page_bytes_per_layer"] * 2 == bf16["page_bytes_per_layer"]
    assert fp8["one_request"]["bytes"] * 2 == bf16["one_request"]["bytes"]


@pytest.mark.usefixtures("fake")
def test_plan_of_a_checkpoint_is_what_llm_allocates(path, capsys):
    """``chunklocal plan --model DIR`` and ``LLM(DIR)`` on a device of the same memory (the
    fake of test_engine_memory: its weights, activations and non-torch growth given to plan)
    size the same pools."""
    llm = chunklocal.LLM(path, gpu_memory_utilization=0.75, **tm.KW)
    reserved = (tm.ACTIVATIONS + tm.CONTEXT) / GIB
    rc, out, err = run_plan(capsys, "--model", str(path), "--dtype", "float32",
                            "--max-num-seqs", "256", "--max-num-batched-tokens", "96",
                            "--max-model-len", "1024", "--device-memory-gib", str(64 / 1024),
                            "--gpu-memory-utilization", "0.75", "--weights-gib",
                            str(tm.WEIGHTS / GIB), "--activations-gib", str(reserved),
                            "--json")
    assert rc == 0, err
    pools = json.loads(out)["kv_pools"]
    assert [(g["name"], g["pages"]) for g in pools["groups"]] == \
        [(g.name, g.pages) for g in llm.kv_pools.groups]
    assert pools["layers"] == {"chunked": 3, "global": 1}
    # Without --weights-gib: the checkpoint's own weights, as the loader sizes them.
    rc, out, _ = run_plan(capsys, "--model", str(path), "--dtype", "float32",
                          "--max-num-seqs", "4", "--max-model-len", "1024",
                          "--device-memory-gib", "1", "--json")
    weights = sum(t.numel() * t.element_size() for t in llm.model.state_dict().values())
    assert json.loads(out)["kv_pools"]["budget"]["weight_bytes"] == weights
