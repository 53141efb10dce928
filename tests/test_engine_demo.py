"""`chunklocal demo` stage 3 (chunklocal.cli.demo_model) on a shorter prompt.

The full default run (36000 tokens) is the README's first command; here the same
code runs a 9000-token prompt (two chunks of c = 8192) so CI stays fast.
"""

from __future__ import annotations

import torch

from chunklocal.cli import demo_model


def test_engine_demo_runs_and_checks(capsys):
    assert demo_model.run_engine_demo(prompt_len=9000, new_tokens=4)
    out, err = capsys.readouterr()
    assert "Writing model shards" not in err and "Loading" not in err  # bars kept quiet
    assert "per step: (9000 tok, 2 vb), 3x(1 tok, 1 vb)" in out
    assert "per step: (8192 tok, 1 vb), (808 tok, 1 vb), 3x(1 tok, 1 vb)" in out
    assert "same 4 new tokens in both runs: yes" in out
    assert "(OK, tolerance 0.0001)" in out


def test_logits_check_rejects_wrong_logits():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(1024, generator=gen)
    assert demo_model.compare_logits(ref + 1e-6, ref, torch.float32)[2]
    noisy = ref + 1e-2 * ref.abs().max() * torch.randn(1024, generator=gen)
    assert not demo_model.compare_logits(noisy, ref, torch.float32)[2]
    ref[:2] = torch.tensor([5.0, 5.0 - 1e-5])  # a near-tie at the top
    flipped = ref.clone()
    flipped[1] += 2e-5  # error 4e-6 relative, but a different argmax
    err, same_top, ok = demo_model.compare_logits(flipped, ref, torch.float32)
    assert err < 1e-5 and not same_top and not ok


def test_quiet_transformers_restores_the_progress_bars():
    from transformers.utils import logging

    assert logging.is_progress_bar_enabled()
    with demo_model.quiet_transformers():
        assert not logging.is_progress_bar_enabled()
    assert logging.is_progress_bar_enabled()
