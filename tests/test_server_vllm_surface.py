"""What a ``vllm serve`` user meets (issue 24): unknown fields ignored with a warning, chat
streams without empty deltas, /version /ping /tokenize /detokenize, 415 for non-JSON
bodies, a waiting limit in sequences, the right ``param`` in errors, 503 on shutdown,
aborts in /metrics under vLLM's names, and tokenization off the request thread, with a
cheap bound refusing texts that cannot fit.  Against the stand-in core (tests/fake_core.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
import fake_core  # noqa: E402
import uvicorn  # noqa: E402
from fake_core import FakeCore, FakeStream  # noqa: E402
from server_harness import serve_args  # noqa: E402

from chunklocal.server import prompts  # noqa: E402

USER = [{"role": "user", "content": "hello"}]


def _error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def _sse(text):
    events = [line[len("data: "):] for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# -- 1. unknown fields: accepted and ignored with a warning naming them (vLLM) -----------------

def test_unknown_fields_are_ignored_with_a_warning(serve, tokenizer, caplog):
    s = serve(FakeCore(tokenizer))
    with caplog.at_level("WARNING", logger="chunklocal.server"):
        r = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "bogus": 1,
                                       "stream": True,
                                       "stream_options": {"include_usage": True, "x": 1}})
        assert r.status_code == 200, r.text
        chat = {"messages": [{"role": "user", "content": "hi", "name": "u"}],
                "max_tokens": 2, "some_client_field": {"a": 1}}
        assert s.post("/v1/chat/completions", chat).status_code == 200
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "ignored" in warned and "bogus" in warned and "stream_options.x" in warned
    assert "some_client_field" in warned
    # Declared but unserved fields are still refused at non-neutral values.
    _error(s.post("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1.0}}), 400,
           "logit_bias")


# -- 2. chat streams: a role chunk, then only chunks with content ------------------------------

class HoldingStream(FakeStream):
    """Every other snapshot adds a token but no text (a partial character held back)."""

    def _snapshot(self, k, reason):
        out = super()._snapshot(k, reason)
        if reason is None and k % 2:
            for o, before in zip(out.outputs, super()._snapshot(k - 1, None).outputs,
                                 strict=True):
                o.text = before.text
        return out


def test_chat_stream_never_sends_an_empty_delta(serve, tokenizer, monkeypatch):
    monkeypatch.setattr(fake_core, "FakeStream", HoldingStream)
    s = serve(FakeCore(tokenizer))
    body = {"messages": USER, "max_tokens": 7, "logprobs": True, "n": 2}
    whole = s.post("/v1/chat/completions", body).json()
    chunks = _sse(s.post("/v1/chat/completions", {**body, "stream": True}).text)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        text = ""
        for choice in mine[1:]:
            if choice["finish_reason"] is None:
                assert isinstance(choice["delta"].get("content"), str), choice
                assert choice["delta"]["content"], choice
            text += choice["delta"].get("content", "")
        assert mine[-1]["finish_reason"] == "length"
        assert text == whole["choices"][index]["message"]["content"]
        streamed = [t["token"] for c in mine if c["logprobs"] for t in c["logprobs"]["content"]]
        assert streamed == [t["token"] for t in whole["choices"][index]["logprobs"]["content"]]


# -- 3. /version, /ping, /tokenize, /detokenize --------------------------------------------------

def test_version_ping_tokenize_detokenize(serve, tokenizer):
    import chunklocal

    s = serve(FakeCore(tokenizer), api_key="sekret")  # not /v1: no key needed, as vLLM
    assert s.client.get("/version").json() == {"version": chunklocal.__version__}
    assert s.client.get("/ping").status_code == 200
    assert s.client.post("/ping").status_code == 200
    r = s.post("/tokenize", {"prompt": "hello world", "model": "tiny"}).json()
    ids = tokenizer("hello world")["input_ids"]
    assert r == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    r = s.post("/tokenize", {"prompt": "hello world", "add_special_tokens": False,
                             "return_token_strs": True}).json()
    plain = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    assert r["tokens"] == plain and r["token_strs"] == tokenizer.convert_ids_to_tokens(plain)
    r = s.post("/tokenize", {"messages": USER}).json()
    templated = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"]
    assert r["tokens"] == templated and r["count"] == len(templated)
    assert s.post("/detokenize", {"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    _error(s.post("/detokenize", {"tokens": [1, 999]}), 400, "tokens")
    _error(s.post("/tokenize", {"prompt": "x", "model": "other"}), 400, "model")
    _error(s.post("/tokenize", {}), 400)


def test_ping_follows_health(serve, tokenizer):
    s = serve(None)
    assert s.client.get("/ping").status_code == 503
    s.state.set_core(FakeCore(tokenizer))
    assert s.client.get("/ping").status_code == 200


# -- 4. only application/json bodies are run ----------------------------------------------------

@pytest.mark.parametrize("headers", [{"content-type": "text/plain"},
                                     {"content-type": "application/x-www-form-urlencoded"},
                                     {}])
def test_a_body_that_is_not_json_gets_415(serve, tokenizer, headers):
    core = FakeCore(tokenizer)
    s = serve(core)
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    for path in ("/v1/completions", "/tokenize"):
        r = s.client.post(path, content=body, headers=headers)
        _error(r, 415, code="unsupported_media_type")
    assert core.added == []
    ok = s.client.post("/v1/completions", content=body,
                       headers={"content-type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200, ok.text


# -- 5. the waiting limit counts sequences ------------------------------------------------------

class SequenceCountingCore(FakeCore):
    """A core whose waiting queue counts sequences and which never starts one (gate shut)."""

    def __init__(self, tokenizer, max_waiting_requests):
        super().__init__(tokenizer)
        self.max_waiting_requests = max_waiting_requests
        self.gate.clear()

    def stats(self):
        return {**super().stats(), "num_running": 0,
                "num_waiting": sum(s.params.n for s in self.live.values())}


def test_waiting_limit_counts_sequences_not_requests(serve, tokenizer):
    core = SequenceCountingCore(tokenizer, 16)
    s = serve(core)
    big = {"prompt": [[5, i] for i in range(64)], "n": 16, "max_tokens": 2}
    _error(s.post("/v1/completions", big), 400, "n", "too_many_sequences")
    assert core.added == []
    pending = [threading.Thread(target=s.post, args=("/v1/completions",
                                                     {"prompt": [[1], [2]], "n": 4,
                                                      "max_tokens": 2})) for _ in range(2)]
    for t in pending:
        t.start()
    deadline = time.time() + 5
    while len(core.live) < 4:
        assert time.time() < deadline
        time.sleep(0.01)
    _error(s.post("/v1/completions", {"prompt": [3], "max_tokens": 2}), 503, code="queue_full")
    assert len(core.added) == 4
    core.gate.set()
    for t in pending:
        t.join(10)
    assert s.post("/v1/completions", {"prompt": [3], "max_tokens": 2}).status_code == 200


# -- 6. the right param in every error ----------------------------------------------------------

def test_errors_name_the_field_the_client_sent(serve, tokenizer):
    core = FakeCore(tokenizer)
    s = serve(core)
    long_chat = [{"role": "user", "content": " ".join(["hello world"] * 200)}]
    _error(s.post("/v1/chat/completions", {"messages": long_chat}), 400, "messages",
           "context_length_exceeded")
    _error(s.post("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 1000}),
           400, "max_completion_tokens")
    _error(s.post("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0}),
           400, "max_completion_tokens")
    _error(s.post("/v1/completions", {"prompt": "hi", "seed": 2**63 - 1, "n": 2}), 400, "seed")
    assert core.added == []
    ok = s.post("/v1/completions", {"prompt": "hi", "seed": 2**63 - 2, "n": 2, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


# -- 7. shutdown: queued non-streamed requests get 503 ------------------------------------------

def test_shutdown_answers_queued_requests_503(serve, tokenizer):
    core = FakeCore(tokenizer)
    core.gate.clear()
    s = serve(core)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault(
        "r", s.post("/v1/completions", {"prompt": "hi", "max_tokens": 5})))
    t.start()
    while not core.live:
        time.sleep(0.01)
    s.state.shutting_down = True  # what SIGTERM does (server/cli.py), then core.shutdown()
    core.shutdown()
    t.join(10)
    err = _error(got["r"], 503, code="shutting_down")
    assert err["type"] == "shutting_down"


# -- 8. aborts counted; duplicate Authorization headers refused ----------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_aborted_requests_are_counted(serve, tokenizer, stream):
    core = FakeCore(tokenizer)
    core.gate.clear()
    s = serve(core)
    with httpx.Client(base_url=s.url, timeout=0.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            with c.stream("POST", "/v1/completions",
                          json={"prompt": "hi", "max_tokens": 50, "stream": stream}) as r:
                for _ in r.iter_raw():
                    pass
    line = 'vllm:request_success_total{finished_reason="abort",model_name="tiny"} 1.0'
    deadline = time.time() + 5
    while line not in s.client.get("/metrics").text:
        assert time.time() < deadline, s.client.get("/metrics").text
        time.sleep(0.02)


def test_duplicate_authorization_headers_are_refused(serve, tokenizer):
    s = serve(FakeCore(tokenizer), api_key="sekret")
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    for pair in (["Bearer wrong", "Bearer sekret"], ["Bearer sekret", "Bearer sekret"]):
        headers = [("content-type", "application/json")] + [("authorization", v) for v in pair]
        r = s.client.post("/v1/completions", content=body, headers=headers)
        _error(r, 401, code="invalid_api_key")
    ok = s.client.post("/v1/completions", content=body,
                       headers={"content-type": "application/json",
                                "authorization": "Bearer sekret"})
    assert ok.status_code == 200


# -- 9. vLLM's metric names --------------------------------------------------------------------

def test_metrics_have_vllm_names_and_model_name(serve, tokenizer):
    s = serve(FakeCore(tokenizer))
    s.post("/v1/completions", {"prompt": "hi", "max_tokens": 3})
    text = s.client.get("/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count"):
        assert f'vllm:{name}{{model_name="tiny"}}' in text, name
        assert f"chunklocal_{name}" not in text, name
    assert 'vllm:request_success_total{finished_reason="length",model_name="tiny"} 1.0' in text
    assert "chunklocal_peak_virtual_batches" in text  # vLLM has no name for it


# -- 12. tokenization off the request thread, bounded before it runs ----------------------------

def test_a_huge_text_is_refused_before_tokenizing(serve, tokenizer, monkeypatch):
    calls = []
    real = prompts.encode
    monkeypatch.setattr(prompts, "encode", lambda *a: calls.append(a[1][:10]) or real(*a))
    s = serve(FakeCore(tokenizer))
    huge = "hello world " * 300_000  # 3.6 MB: under the 4 MiB body limit
    start = time.perf_counter()
    _error(s.post("/v1/completions", {"prompt": huge}), 400, "prompt", "context_length_exceeded")
    _error(s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
           400, "messages", "context_length_exceeded")
    assert time.perf_counter() - start < 5
    assert calls == []
    assert s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_the_bound_is_a_lower_bound(tokenizer):
    longest = prompts.max_token_bytes(tokenizer)
    assert longest == max(len(t.encode()) for t in tokenizer.get_vocab())
    for text in ("hello world " * 50, "naïve café 数据 🙂 " * 40, "x" * 3000):
        n = len(tokenizer(text)["input_ids"])
        assert -(-len(text.encode()) // longest) <= n


def test_work_of_a_disconnected_client_is_dropped(serve, tokenizer, monkeypatch):
    release, calls = threading.Event(), []
    real = prompts.encode

    def encode(tok, text, special):
        calls.append(text)
        if text == "block":
            release.wait(10)
        return real(tok, text, special)

    monkeypatch.setattr(prompts, "encode", encode)
    s = serve(FakeCore(tokenizer), tokenize_workers=1)
    first = threading.Thread(target=s.post, args=("/v1/completions",
                                                  {"prompt": "block", "max_tokens": 2}))
    first.start()
    while not calls:
        time.sleep(0.01)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{s.url}/v1/completions", json={"prompt": "gone", "max_tokens": 2},
                   timeout=0.3)
    time.sleep(0.3)  # the server sees the disconnect
    release.set()
    first.join(10)
    assert s.post("/v1/completions", {"prompt": "after", "max_tokens": 2}).status_code == 200
    assert calls == ["block", "after"]


def test_tokenizing_runs_on_several_threads(serve, tokenizer, monkeypatch):
    inside, both = [], threading.Event()
    real = prompts.encode

    def encode(tok, text, special):
        inside.append(text)
        if len(inside) >= 2:
            both.set()
        both.wait(5)
        return real(tok, text, special)

    monkeypatch.setattr(prompts, "encode", encode)
    s = serve(FakeCore(tokenizer))
    threads = [threading.Thread(target=s.post, args=("/v1/completions",
                                                     {"prompt": p, "max_tokens": 2}))
               for p in ("one", "two")]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert both.is_set() and time.perf_counter() - start < 4


# -- 11. chunklocal --version without torch -------------------------------------------------------

def test_version_flag_imports_no_torch():
    code = ("import sys\nfrom chunklocal import cli\ntry:\n    cli.main(['--version'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert "chunklocal" in out.stdout and out.stdout.split()[-1] == "False", out


# -- 10. --chat-template, --tokenizer; the model loads before the port opens --------------------

def test_chat_template_and_tokenizer_flags(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE_TEXT)
    assert serve_args(str(tmp_path), "--chat-template", str(template)).chat_template == \
        TEMPLATE_TEXT
    assert serve_args(str(tmp_path), "--chat-template", TEMPLATE_TEXT).chat_template == \
        TEMPLATE_TEXT
    assert serve_args(str(tmp_path), "--tokenizer", str(tmp_path)).tokenizer == str(tmp_path)
    for bad in (["--chat-template", str(tmp_path / "missing.jinja")],
                ["--tokenizer", str(tmp_path / "nope")]):
        with pytest.raises(SystemExit) as info:
            serve_args(str(tmp_path), *bad)
        assert info.value.code == 2


TEMPLATE_TEXT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_the_servers_chat_template_is_used(serve, tokenizer):
    core = FakeCore(tokenizer)
    s = serve(core, chat_template=TEMPLATE_TEXT)
    assert s.post("/v1/chat/completions", {"messages": USER, "max_tokens": 2}).status_code == 200
    assert core.added[-1].ids == tokenizer("hello", add_special_tokens=False)["input_ids"]
    assert s.post("/tokenize", {"messages": USER}).json()["tokens"] == core.added[-1].ids


def test_a_bad_model_fails_before_the_port_opens(tmp_path, monkeypatch):

    from chunklocal.server import cli as serve_cli

    ran = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: ran.append(self))

    def bad_core(args):
        raise ValueError("config.json: no such model")

    monkeypatch.setattr(serve_cli, "make_core", bad_core)
    monkeypatch.setattr(serve_cli.signal, "signal", lambda *a: None)  # keep pytest's handlers
    (tmp_path / "config.json").write_text("{}")
    args = serve_args(str(tmp_path), "--port", "8123")
    assert serve_cli.main(args) == 1
    assert ran == []  # uvicorn never started: nothing listened
