"""Checkpoint and prompt edges found by a user's tests: a tied head that the files
contradict, an index naming files outside its folder, booleans among token ids.

Oracle for the tied head: transformers itself, where its versions agree (4.57 ties and
drops a stored head, 5.x keeps it: a stored head that differs is refused, one equal to
the embedding gives transformers' logits on either version)."""

from __future__ import annotations

import json

import pytest
import torch
from llama4_tiny import hf_logits, rel_err, write_tiny_llama4
from safetensors.torch import load_file, save_file

import chunklocal

ENGINE = dict(device="cpu", dtype=torch.float32, max_model_len=64)


def tie_in_config(path):
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(config))


def test_a_tied_config_with_a_different_stored_head_is_refused(tmp_path):
    write_tiny_llama4(tmp_path, seed=3, tie_word_embeddings=False)
    tie_in_config(tmp_path)
    with pytest.raises(ValueError, match="tie_word_embeddings.*lm_head.weight.*differs"):
        chunklocal.LLM(tmp_path, **ENGINE)


def test_a_tied_config_with_the_embedding_stored_as_head_loads(tmp_path):
    hf = write_tiny_llama4(tmp_path, seed=3, tie_word_embeddings=False)
    file = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(str(file))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(file), metadata={"format": "pt"})
    tie_in_config(tmp_path)
    with torch.no_grad():
        hf.lm_head.weight.copy_(hf.model.embed_tokens.weight)
    prompt = list(range(1, 30))
    got = chunklocal.LLM(tmp_path, **ENGINE).prompt_logits([prompt])[0]
    assert rel_err(got, hf_logits(hf, prompt)) < 1e-5


def test_an_index_naming_a_file_outside_its_folder_is_refused(tmp_path):
    outside, inside = tmp_path / "other", tmp_path / "ckpt"
    write_tiny_llama4(outside, seed=3)
    write_tiny_llama4(inside, seed=3)
    name = next(inside.glob("*.safetensors")).name
    keys = load_file(str(inside / name)).keys()
    index = {"metadata": {}, "weight_map": {k: f"../other/{name}" for k in keys}}
    (inside / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="outside"):
        chunklocal.LLM(inside, **ENGINE)


@pytest.mark.parametrize("prompt", [[1, True], (True, 5), [False]])
def test_booleans_among_token_ids_are_refused(tmp_path, prompt):
    write_tiny_llama4(tmp_path, seed=3)
    llm = chunklocal.LLM(tmp_path, **ENGINE)
    with pytest.raises(ValueError, match="prompt 0: expected a flat list of int token ids"):
        llm.generate([prompt], max_new_tokens=2)
    assert len(llm.generate([[1, 2, 3]], max_new_tokens=2)[0]) == 2
