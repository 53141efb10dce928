"""`chunklocal serve` arguments: every LLM argument has a flag with LLM's default, and bad
flags are refused by argparse (exit status 2) before anything loads."""

from __future__ import annotations

import argparse
import inspect

import pytest

from chunklocal import cli
from chunklocal.engine.llm import LLM
from chunklocal.server import cli as serve_cli


def parse(*argv):
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    return parser, parser.parse_args(list(argv))


def test_every_llm_argument_has_a_flag_with_its_default(tmp_path):
    params = inspect.signature(LLM.__init__).parameters
    _, args = parse(str(tmp_path))
    missing = [name for name in params if name not in ("self", "model")
               and name not in serve_cli.LLM_FLAGS]
    assert not missing, f"LLM arguments without a serve flag: {missing}"
    kwargs = serve_cli.llm_kwargs(args)
    for name, param in params.items():
        if name in ("self", "model"):
            continue
        assert name in kwargs
        expected = param.default
        if name == "device":  # serve picks cuda when there is one
            continue
        if name == "dtype":
            assert args.dtype == "auto" and expected is None
            continue
        assert kwargs[name] == expected, (name, kwargs[name], expected)


def test_vllm_flag_names():
    _, args = parse("m", "--num-gpu-blocks-override", "77", "--enforce-eager",
                    "--disable-hybrid-kv-cache-manager", "--served-model-name", "a", "b")
    assert args.num_kv_blocks == 77 and args.cuda_graphs is False
    assert args.hybrid_kv_cache is False and args.served_model_name == ["a", "b"]
    assert parse("m", "--num-kv-blocks", "5")[1].num_kv_blocks == 5
    assert serve_cli.llm_kwargs(parse("m")[1])["enable_prefix_caching"] is True
    off = serve_cli.llm_kwargs(parse("m", "--no-enable-prefix-caching")[1])
    assert off["enable_prefix_caching"] is False
    assert parse("m")[1].host == "127.0.0.1"


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv(serve_cli.API_KEY_ENV, "k1")
    assert parse("m")[1].api_key == "k1"
    assert parse("m", "--api-key", "k2")[1].api_key == "k2"


@pytest.mark.parametrize("argv", [
    ["--port", "0"], ["--port", "70000"], ["--max-n", "0"], ["--max-num-seqs", "-1"],
    ["--block-size", "x"], ["--max-waiting-requests", "0"], ["--max-request-bytes", "0"],
    ["--api-key", ""], ["--load-format", "pt"],
])
def test_bad_flags_exit_2(tmp_path, capsys, argv):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", str(tmp_path), *argv])
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_model_must_be_a_checkpoint_directory(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", str(tmp_path / "nope")])
    assert info.value.code == 2
    assert "config.json" in capsys.readouterr().err


def test_the_engine_core_runs_in_its_own_process_unless_told_otherwise(tmp_path, monkeypatch):
    """Default since the H200 load test of 2026-12-02 (BENCHMARKS.md): ``make_core`` builds
    a ProcessCore; ``--no-engine-process`` keeps the LLM's core in the server's process."""
    from chunklocal.engine import core_process

    built = []
    monkeypatch.setattr(core_process, "ProcessCore", lambda *a: built.append("process"))
    monkeypatch.setattr(serve_cli, "_llm_class", lambda: (lambda *a, **kw: built.append("llm")))
    assert parse(str(tmp_path))[1].engine_process is True
    serve_cli.make_core(parse(str(tmp_path))[1])
    assert built == ["process"]
    assert parse(str(tmp_path), "--no-engine-process")[1].engine_process is False
    with pytest.raises(AttributeError):  # the stand-in LLM has no core: it was the one built
        serve_cli.make_core(parse(str(tmp_path), "--no-engine-process")[1])
    assert built == ["process", "llm"]
