"""``LLM.generate`` takes vLLM's prompt dicts: TextPrompt ``{"prompt": str}`` and
TokensPrompt ``{"prompt_token_ids": [...]}``, alone, in lists, mixed with each other and
with the plain forms; other shapes are ValueErrors naming the prompt and the keys."""

from __future__ import annotations

import shutil

import pytest

import chunklocal
from chunklocal.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, ckpt):
    from tiny_tokenizer import write_tiny_tokenizer

    path = tmp_path_factory.mktemp("dicts") / "model"
    shutil.copytree(ckpt[0], path)
    write_tiny_tokenizer(path, vocab_size=384)
    return chunklocal.LLM(path, max_model_len=64, generation_config="none")


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_prompt_dicts_generate_as_the_plain_forms(llm):
    text, ids = "Hello there", [5, 6, 7, 8]
    plain_text, plain_ids = llm.generate([text], GREEDY), llm.generate([ids], GREEDY)
    got = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], GREEDY)
    assert _ids(got) == _ids(plain_text) + _ids(plain_ids)
    assert [o.prompt for o in got] == [text, None]
    assert got[0].prompt_token_ids == plain_text[0].prompt_token_ids
    assert got[1].prompt_token_ids == ids
    one = llm.generate({"prompt": text}, GREEDY)  # a single dict, as a single string
    assert _ids(one) == _ids(plain_text) and one[0].prompt == text
    mixed = llm.generate([{"prompt_token_ids": ids}, text], GREEDY)
    assert _ids(mixed) == _ids(plain_ids) + _ids(plain_text)
    assert _ids(llm.generate([{"prompt_token_ids": ids}] * 2, GREEDY)) == _ids(plain_ids) * 2


@pytest.mark.parametrize("prompt, match", [
    ({}, r"prompt 0: a prompt dict holds exactly one of 'prompt'.*got keys \[\]"),
    ({"prompt": "a", "prompt_token_ids": [1]}, r"prompt 0: .*exactly one.*'prompt_token_ids'"),
    ({"prompt": "a", "seed": 3}, r"prompt 0: .*got keys \['prompt', 'seed'\]"),
    ({"prompt": 5}, r"prompt 0: 'prompt' must be a string, got int"),
    ({"prompt_token_ids": "12"}, r"prompt 0: 'prompt_token_ids' must be a list of token ids"),
    ({"prompt_token_ids": [1, "x"]}, r"prompt 0: expected a flat list of int token ids"),
    ({"prompt_token_ids": []}, r"prompt 0 is empty"),
])
def test_bad_prompt_dicts_are_refused_by_name(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], GREEDY)
    with pytest.raises(ValueError, match=match.replace("prompt 0", "prompt 1")):
        llm.generate([{"prompt": "fine"}, prompt], GREEDY)
