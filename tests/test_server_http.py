"""The HTTP layer of ``chunklocal serve`` against a stand-in core (tests/fake_core.py):
protocol shapes, refusals (400 / 401 / 503 with OpenAI's error JSON), disconnects and
metrics, fast and without a model.  tests/test_server_e2e.py runs the real engine."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
from fake_core import FakeCore  # noqa: E402
from tiny_tokenizer import write_tiny_tokenizer  # noqa: E402

from chunklocal.server.params import ServeLimits  # noqa: E402


def _error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def _sse(text):
    events = [line[len("data: "):] for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_stream_equals_non_stream(serve, tokenizer):
    s = serve(FakeCore(tokenizer))
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 9}
    whole = s.post("/v1/completions", body).json()
    ids = tokenizer("hello world")["input_ids"]
    expected = [(sum(ids) + 7 * j) % 384 for j in range(9)]
    assert whole["choices"][0]["text"] == tokenizer.decode(expected)
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 9,
                              "total_tokens": len(ids) + 9,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    assert whole["object"] == "text_completion" and whole["model"] == "tiny"
    chunks = _sse(s.post("/v1/completions", {**body, "stream": True,
                                             "stream_options": {"include_usage": True}}).text)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
        whole["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"


def test_n_and_batch_prompts_index_choices(serve, tokenizer):
    s = serve(FakeCore(tokenizer))
    r = s.post("/v1/completions", {"prompt": [[1, 2], [3]], "max_tokens": 3, "n": 2}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["usage"]["prompt_tokens"] == 3 and r["usage"]["completion_tokens"] == 12
    toks = [c["text"] for c in r["choices"]]
    assert toks[0] == tokenizer.decode([3, 10, 17]) and toks[3] == tokenizer.decode([4, 11, 18])


def test_chat_one_bos_and_role_chunk(serve, tokenizer):
    core = FakeCore(tokenizer)
    s = serve(core)
    msgs = [{"role": "user", "content": "hello"}]
    r = s.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 4}).json()
    ids = core.added[-1].ids
    assert ids == tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1
    assert r["choices"][0]["message"]["role"] == "assistant"
    chunks = _sse(s.post("/v1/chat/completions",
                         {"messages": msgs, "max_tokens": 4, "stream": True}).text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == r["choices"][0]["message"]["content"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "hi", "n": True}, "n"),
    ({"prompt": "hi", "model": "other"}, "model"),
    ({"prompt": "hi", "max_tokens": 1000}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": [5] * 256}, "prompt"),
    ({"prompt": [5, 999]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "hi", "n": 17}, "n"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "temperature": -1.0}, "temperature"),
    ({"prompt": "hi", "top_p": 2.0}, "top_p"),
    ({}, "prompt"),
])
def test_bad_completion_gets_400_and_server_keeps_serving(serve, tokenizer, body, param):
    core = FakeCore(tokenizer)
    s = serve(core)
    _error(s.post("/v1/completions", body), 400, param)
    assert core.added == []  # nothing reached the engine
    assert s.client.get("/health").status_code == 200
    assert s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_neutral_values_of_unserved_fields_pass(serve, tokenizer):
    s = serve(FakeCore(tokenizer))
    body = {"prompt": "hi", "max_tokens": 2, "logit_bias": {}, "best_of": 1, "echo": False,
            "min_tokens": 0, "use_beam_search": False, "user": "u", "top_k": -1}
    assert s.post("/v1/completions", body).status_code == 200
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 2, "tools": None, "tool_choice": "none", "store": False}
    assert s.post("/v1/chat/completions", chat).status_code == 200


def test_bad_chat_requests(serve, tokenizer, tmp_path):
    s = serve(FakeCore(tokenizer))
    _error(s.post("/v1/chat/completions", {"messages": []}), 400, "messages")
    _error(s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                           "tools": [{"type": "function"}]}), 400,
           "tools[0].function")
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    _error(s.post("/v1/chat/completions", {"messages": [image]}), 400, "messages[0].content")
    textless = {"role": "user", "content": [{"type": "text"}]}
    err = _error(s.post("/v1/chat/completions", {"messages": [textless]}), 400)
    assert "needs a string 'text'" in err["message"]
    wrong_method = s.client.get("/v1/completions")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    _error(s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                           "top_logprobs": 2}), 400, "top_logprobs")
    write_tiny_tokenizer(tmp_path, chat_template=False)
    from transformers import AutoTokenizer

    bare = serve(FakeCore(AutoTokenizer.from_pretrained(str(tmp_path))))
    err = _error(bare.post("/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "x"}]}), 400)
    assert err["code"] == "no_chat_template"
    no_tok = serve(FakeCore(None))
    assert _error(no_tok.post("/v1/completions", {"prompt": "x"}), 400)["code"] == "no_tokenizer"
    assert no_tok.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2}).status_code == 200


def test_body_limit_and_invalid_json(serve, tokenizer):
    s = serve(FakeCore(tokenizer), limits=ServeLimits(max_request_bytes=1000))
    big = {"prompt": "x" * 2000}
    assert _error(s.post("/v1/completions", big), 400)["code"] == "request_too_large"
    r = s.client.post("/v1/completions", content=b"{not json",
                      headers={"content-type": "application/json"})
    _error(r, 400)
    assert s.client.get("/nope").status_code == 404
    assert "error" in s.client.get("/nope").json()


def test_api_key(serve, tokenizer):
    s = serve(FakeCore(tokenizer), api_key="sekret")
    body = {"prompt": "hi", "max_tokens": 2}
    assert _error(s.post("/v1/completions", body), 401)["code"] == "invalid_api_key"
    _error(s.post("/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    _error(s.client.get("/v1/models"), 401)
    ok = {"Authorization": "Bearer sekret"}
    assert s.post("/v1/completions", body, headers=ok).status_code == 200
    assert s.client.get("/v1/models", headers=ok).json()["data"][0]["id"] == "tiny"
    assert s.client.get("/health").status_code == 200
    assert 'chunklocal_http_errors_total{status="401"} 3.0' in s.client.get("/metrics").text


def test_health_503_until_loaded(serve, tokenizer):
    s = serve(None)
    assert s.client.get("/health").status_code == 503
    assert _error(s.post("/v1/completions", {"prompt": "hi"}), 503)["code"] == "model_loading"
    s.state.set_core(FakeCore(tokenizer))
    assert s.client.get("/health").status_code == 200


def test_full_queue_gets_503_and_adds_nothing(serve, tokenizer):
    core = FakeCore(tokenizer, max_waiting=2)
    core.gate.clear()
    s = serve(core)
    # Two prompts of one request fill the queue; a third is refused whole.
    pending = threading.Thread(target=s.post, args=("/v1/completions",
                                                    {"prompt": [[1], [2]], "max_tokens": 2}))
    pending.start()
    while len(core.live) < 2:
        time.sleep(0.01)
    err = _error(s.post("/v1/completions", {"prompt": [[3], [4]], "max_tokens": 2}), 503)
    assert err["code"] == "queue_full"
    core.gate.set()
    pending.join(10)
    assert len(core.added) == 2
    assert s.post("/v1/completions", {"prompt": [[3], [4]], "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts(serve, tokenizer, stream):
    core = FakeCore(tokenizer)
    core.gate.clear()
    s = serve(core)
    body = {"prompt": "hi", "max_tokens": 50, "stream": stream}
    with httpx.Client(base_url=s.url, timeout=0.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            with c.stream("POST", "/v1/completions", json=body) as r:
                for _ in r.iter_raw():
                    pass
    deadline = time.time() + 5
    while not core.aborted:
        assert time.time() < deadline, "the disconnected request was not aborted"
        time.sleep(0.01)
    assert core.aborted == [core.added[0].request_id]


def test_metrics(serve, tokenizer):
    s = serve(FakeCore(tokenizer))
    s.post("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True})
    s.post("/v1/completions", {"prompt": "hi", "n": 17})
    text = s.client.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "chunklocal_peak_virtual_batches",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket"):
        assert name in text, name
    assert 'vllm:time_to_first_token_seconds_count{model_name="tiny"} 1.0' in text
    assert 'vllm:inter_token_latency_seconds_count{model_name="tiny"} 2.0' in text
    assert ('vllm:request_success_total{finished_reason="length",model_name="tiny"} 1.0'
            in text)
    assert 'chunklocal_http_errors_total{status="400"} 1.0' in text


def test_logprobs_shapes(serve, tokenizer):
    s = serve(FakeCore(tokenizer))
    r = s.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 3, "logprobs": 1}).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([t]) for t in (3, 10, 17)]
    assert lp["token_logprobs"] == [-1.0] * 3
    assert lp["top_logprobs"] == [{tokenizer.decode([t]): -1.0} for t in (3, 10, 17)]
    offsets = [0, len(lp["tokens"][0]), len(lp["tokens"][0]) + len(lp["tokens"][1])]
    assert lp["text_offset"] == offsets
    msgs = [{"role": "user", "content": "hi"}]
    chat = s.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "logprobs": True,
                                           "top_logprobs": 2}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and [len(c["top_logprobs"]) for c in content] == [2, 2]
    assert content[0]["top_logprobs"][0]["logprob"] == -1.0
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    chunks = _sse(s.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 2,
                                                  "logprobs": True, "stream": True}).text)
    streamed = [c for ch in chunks for choice in ch["choices"] if choice["logprobs"]
                for c in choice["logprobs"]["content"]]
    assert [c["token"] for c in streamed] == [c["token"] for c in content]
    assert all(c["top_logprobs"] == [] for c in streamed)  # top_logprobs unset: 0


def test_continuous_usage_and_stop_token_ids_limit(serve, tokenizer):
    s = serve(FakeCore(tokenizer))
    chunks = _sse(s.post("/v1/completions", {
        "prompt": [1, 2], "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).text)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == [1, 2, 3, 4, 4]
    _error(s.post("/v1/completions", {"prompt": "x", "stop_token_ids": list(range(17))}), 400,
           "stop_token_ids")


def test_chunked_body_over_the_limit(serve, tokenizer):
    s = serve(FakeCore(tokenizer), limits=ServeLimits(max_request_bytes=1000))

    def body():  # no Content-Length: the server counts while reading
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    r = s.client.post("/v1/completions", content=body(),
                      headers={"content-type": "application/json"})
    assert _error(r, 400)["code"] == "request_too_large"
    assert s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("prompt", [[2, 5], [[1, 5], [2, 5]]])
def test_engine_failure_is_reported_not_truncated(serve, tokenizer, prompt):
    core = FakeCore(tokenizer)
    core.fail_at = 3
    s = serve(core)
    body = {"prompt": prompt, "max_tokens": 6}
    err = _error(s.post("/v1/completions", body), 500)
    assert "step failed" in err["message"]
    text = s.post("/v1/completions", {**body, "stream": True}).text
    events = [e[len("data: "):] for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]" and "step failed" in json.loads(events[-2])["error"]["message"]
    assert s.client.get("/health").status_code == 200


def test_default_body_limit_follows_max_model_len():
    assert ServeLimits().body_limit(None) == 4 << 20
    assert ServeLimits().body_limit(1 << 20) == 16 << 20  # a 1M-token prompt fits
    assert ServeLimits(max_request_bytes=10).body_limit(1 << 20) == 10
    ids = list(range(200_000, 200_000 + 1000))  # the longest ids of a 202k vocabulary
    assert len(json.dumps({"prompt": ids * 1024})) < ServeLimits().body_limit(1024 * 1000)


# -- edges a user's black-box run found: null for an OpenAI field means its default, and a
# request's own chat_template needs the server's consent (--trust-request-chat-template,
# vLLM's flag): it renders unbounded on the server's one tokenizer thread.

USER = [{"role": "user", "content": "hello"}]
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "n": None, "stream": None, "echo": None,
                         "logprobs": None, "add_special_tokens": None}),
    ("/v1/chat/completions", {"messages": USER, "n": None, "stream": None, "logprobs": None,
                              "add_generation_prompt": None, "max_completion_tokens": None}),
])
def test_null_fields_take_their_defaults(serve, tokenizer, path, body):
    core = FakeCore(tokenizer)
    s = serve(core)
    plain = {k: v for k, v in body.items() if v is not None}
    with_nulls = s.post(path, dict(body, max_tokens=3))
    assert with_nulls.status_code == 200, with_nulls.text
    assert s.post(path, dict(plain, max_tokens=3)).json()["choices"] == \
        with_nulls.json()["choices"]
    assert core.added[0].ids == core.added[1].ids  # add_generation_prompt etc. defaulted


def test_null_for_a_required_field_is_still_refused(serve, tokenizer):
    s = serve(FakeCore(tokenizer))
    _error(s.post("/v1/completions", {"prompt": None}), 400, "prompt")
    _error(s.post("/v1/chat/completions", {"messages": None}), 400, "messages")


def test_a_request_chat_template_needs_the_servers_consent(serve, tokenizer):
    core = FakeCore(tokenizer)
    strict = serve(core)
    _error(strict.post("/v1/chat/completions",
                       {"messages": USER, "chat_template": TEMPLATE}), 400, "chat_template")
    assert core.added == []
    trusting = serve(core, limits=ServeLimits(trust_request_chat_template=True))
    r = trusting.post("/v1/chat/completions",
                      {"messages": USER, "chat_template": TEMPLATE, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert core.added[-1].ids == tokenizer("hello", add_special_tokens=False)["input_ids"]
    chunks = _sse(trusting.post("/v1/chat/completions", {"messages": USER, "max_tokens": 2,
                                                         "stream": True}).text)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
