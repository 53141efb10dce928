"""benchmarks/device_calls.sh, the GPU calls the runbook owes, checked on the CPU.

A call costs minutes of scarce device time, and a typo in it (a renamed flag, switch,
test or variant) is found only when it runs.  These read the script and hold each
reference to what exists: the shell parses; every ``benchmarks.X`` module exists and takes
every flag its command lines give it; ``--serve-args`` are flags of ``chunklocal serve``;
switch_ab's switches and models exist; every pytest file exists and every ``-k`` term
names something in those files; every ``CHUNKLOCAL_*`` variable is a documented switch;
every prefill variant a default list names is one ``variant_env`` knows; the ``unknown
call`` message lists exactly the cases there are.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "device_calls.sh"


def script_text() -> str:
    return SCRIPT.read_text()


def joined_lines() -> list[str]:
    """The script's lines with backslash continuations joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", script_text())
    return [re.sub(r"(^|\s)#.*$", "", line) for line in text.splitlines()]


def module_help(module: str) -> str:
    """``python -m benchmarks.<module> --help`` without a new interpreter."""
    mod = importlib.import_module(f"benchmarks.{module}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        mod.main(["--help"])
    return out.getvalue()


def flags_of(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))


def benchmark_commands() -> list[tuple[str, str]]:
    """(module, the rest of its command line) for every benchmarks.X invocation."""
    found = []
    for line in joined_lines():
        for match in re.finditer(r"benchmarks\.([a-z_0-9]+)(.*)", line):
            rest = re.split(r"[|;)>]|&&", match.group(2))[0]
            found.append((match.group(1), rest))
    return found


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_script_parses():
    run = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_every_benchmark_takes_the_flags_it_is_given():
    commands = benchmark_commands()
    assert len({module for module, _ in commands}) >= 8, commands
    helps: dict[str, str] = {}
    for module, rest in commands:
        serve_args = re.search(r'--serve-args\s+"([^"]*)"', rest)
        if serve_args:
            rest = rest.replace(serve_args.group(0), "--serve-args X")
            check_serve_flags(serve_args.group(1))
        if module not in helps:
            helps[module] = module_help(module)
        unknown = flags_of(rest) - flags_of(helps[module])
        assert not unknown, f"benchmarks.{module} does not take {sorted(unknown)}: {rest}"


def check_serve_flags(args: str):
    import argparse

    from chunklocal.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    known = {opt for action in parser._actions for opt in action.option_strings}
    unknown = flags_of(args) - known
    assert not unknown, f"chunklocal serve does not take {sorted(unknown)}"


def test_the_model_variables_are_flags_of_their_benchmarks():
    """``model`` (switch_ab), ``pmodel`` (prefill_profile) and ``tmodel`` are set in
    variables, not on the command lines the test above reads."""
    from benchmarks import decode_floor

    text = script_text()
    models = set(re.findall(r"\b(scout-fp8(?:-\d+)?)\b", text))
    assert models and models <= set(decode_floor.MODELS), models - set(decode_floor.MODELS)
    for variable, module in (("model", "switch_ab"), ("pmodel", "prefill_profile")):
        values = re.findall(rf'\b{variable}="([^"]*)"', text)
        assert values, variable
        known = flags_of(module_help(module))
        for value in values:
            assert flags_of(value) <= known, (variable, value)


def test_switch_ab_switches_exist():
    from benchmarks import switch_ab

    known = set(switch_ab.SWITCHES) | set(switch_ab.LAYER_SWITCHES)
    used = set()
    for module, rest in benchmark_commands():
        if module == "switch_ab":
            listed = re.search(r"--switches\s+(.*?)(?=\s--|$)", rest)
            assert listed, rest
            for word in listed.group(1).split():
                used.update(word.split("+"))
    assert used and used <= known, used - known


def test_pytest_files_and_selections_exist():
    text = script_text()
    files = set(re.findall(r"tests/gpu/[a-z_0-9]+\.py", text))
    assert len(files) >= 8, files
    for name in files:
        assert (ROOT / name).is_file(), name
    for line in joined_lines():
        if "tests/gpu" not in line or " -k " not in line:
            continue
        paths = re.findall(r"tests/gpu/[a-z_0-9]+\.py", line)
        source = "\n".join((ROOT / p).read_text() for p in paths)
        expr = re.search(r'-k\s+"([^"]+)"|-k\s+(\S+)', line)
        assert expr, line
        terms = re.split(r"\s+(?:or|and|not)\s+|[()]", expr.group(1) or expr.group(2))
        for term in filter(None, (t.strip() for t in terms)):
            assert term in source, f"-k {term!r} names nothing in {paths}"


def test_switch_variables_are_documented():
    documented = set(re.findall(r"`(CHUNKLOCAL_[A-Z0-9_]+)`",
                                (ROOT / "docs" / "switches.md").read_text()))
    used = set(re.findall(r"\b(CHUNKLOCAL_[A-Z0-9_]+)=", script_text())) - {"CHUNKLOCAL_TEST_LOG"}
    assert used and used <= documented, used - documented


def test_prefill_variants_are_known():
    text = script_text()
    body = re.search(r"variant_env\(\)(.*?)\n}", text, re.S).group(1)
    known = set(re.findall(r"^\s*(?:case \$1 in\s+)?([a-z0-9]+)\)", body, re.M))
    assert {"defaults", "onepass", "all", "own0", "paged"} <= known, known
    lists = re.findall(r"(?:PREFILL_VARIANTS|VECRANK_VARIANTS|ORACLE_VARIANTS):-([^}]*)}", text)
    lists += re.findall(r'(?:oracle_tests|variant_env) "?([a-z0-9+]+)"? ', text)
    used = {part for entry in lists for word in entry.split() for part in word.split("+")}
    targets = re.search(r"for v in (tpot_\w+ [^;]*);", text)
    assert targets, "the targets call's variant list"
    used |= {w.removeprefix("prefill_") for w in targets.group(1).split()
             if w.startswith("prefill_")}
    assert used and used <= known, used - known


def test_the_unknown_call_message_lists_the_cases():
    text = script_text()
    main = text[text.index('case ${1:-ab} in'):]
    labels = set()
    for found in re.findall(r"^  ([a-z0-9|]+)\)", main, re.M):
        labels.update(found.split("|"))
    listed = re.search(r"unknown call: \$1 \(([^)]*)\)", text).group(1)
    assert labels == {name.strip() for name in listed.split(",")}
