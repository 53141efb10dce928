"""``chunklocal serve`` as a real process on localhost, driven by the official ``openai``
client, on the CPU in float32 (issue 13's acceptance).

Oracle: the offline engine, ``LLM(DIR, device="cpu", dtype=torch.float32,
max_model_len=256, block_size=4)`` in this process (greedy float32 on the CPU is
batch-invariant: see test_engine_threads.py), on the same tiny checkpoint and tokenizer;
for logprobs, the offline engine's own prompt logits.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

import chunklocal  # noqa: E402
from benchmarks.serve import free_port, launch_server, wait_healthy  # noqa: E402

# TEMPORARY until branch `core` (engine core + sampling) is merged into `server`.
SamplingParams = pytest.importorskip("chunklocal.engine.sampling").SamplingParams

SERVE_ARGS = ["--host", "127.0.0.1", "--device", "cpu", "--dtype", "float32",
              "--max-model-len", "256", "--block-size", "4", "--max-num-seqs", "8"]
WORDS = ("the quick brown fox jumps over the lazy dog chunked local attention serving "
         "naïve café 数据 🙂 hello world").split()


@pytest.fixture(scope="module")
def ckpt(served_ckpt):
    return served_ckpt


class Server:
    def __init__(self, ckpt, log_dir, args=(), env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = launch_server(ckpt, self.port, [*SERVE_ARGS, *args], env=env, log=self.log)
        try:
            wait_healthy(self.url, self.proc, timeout=180)
        except BaseException:
            self.stop()
            raise

    def client(self, api_key="unused", **kw):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                             timeout=120, **kw)

    def metrics(self) -> dict:
        out = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(("vllm:", "chunklocal_")) and line.count("=") <= 1:
                name, value = line.rsplit(" ", 1)
                out[name.split("{model_name=", 1)[0]] = float(value)  # one label at most
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module", params=["engine-thread", "engine-process"])
def server(ckpt, tmp_path_factory, request):
    """The server with its engine core in a thread (``--no-engine-process``), and in a
    process of its own (the default): every test below holds for both."""
    args = [] if request.param == "engine-process" else ["--no-engine-process"]
    s = Server(ckpt, tmp_path_factory.mktemp("logs"), args)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(ckpt):
    return chunklocal.LLM(ckpt, device="cpu", dtype=torch.float32, max_model_len=256,
                          block_size=4)


def offline(llm, prompts, **params):
    """Offline texts (and outputs) for string prompts or token-id prompts."""
    outs = llm.generate(prompts, SamplingParams(**params))
    return [o.outputs[0] for o in outs]


def text_prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def test_stream_equals_non_stream_equals_offline(server, llm):
    client = server.client()
    prompts = [text_prompt(1, 3), text_prompt(2, 30), text_prompt(3, 60)]
    want = offline(llm, prompts, max_tokens=40, temperature=0.0, ignore_eos=True)
    for prompt, expected in zip(prompts, want, strict=True):
        whole = client.completions.create(model=str(server_ckpt(server)), prompt=prompt,
                                          max_tokens=40, **GREEDY)
        assert whole.choices[0].text == expected.text
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens == 40
        chunks = list(client.completions.create(
            model=str(server_ckpt(server)), prompt=prompt, max_tokens=40, stream=True,
            stream_options={"include_usage": True}, **GREEDY))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 40
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def server_ckpt(server):
    return server.client().models.list().data[0].id


def test_32_concurrent_requests_each_equal_offline(server, llm):
    rng = random.Random(7)
    prompts = [text_prompt(100 + i, rng.randrange(1, 80)) for i in range(32)]
    max_tokens = [rng.randrange(1, 60) for _ in prompts]
    want = [offline(llm, [p], max_tokens=m, temperature=0.0, ignore_eos=True)[0].text
            for p, m in zip(prompts, max_tokens, strict=True)]
    model = server_ckpt(server)
    client = server.client()

    def one(i):
        kw = dict(model=model, prompt=prompts[i], max_tokens=max_tokens[i], **GREEDY)
        if i % 2:
            return "".join(c.choices[0].text for c in client.completions.create(
                stream=True, **kw) if c.choices)
        return client.completions.create(**kw).choices[0].text

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, range(32)))
    assert got == want


def test_seeded_sampling_is_reproducible(server):
    client, model = server.client(), server_ckpt(server)
    kw = dict(model=model, prompt=text_prompt(5, 20), max_tokens=30, temperature=1.0,
              top_p=0.95, extra_body={"ignore_eos": True, "top_k": 50})
    first = client.completions.create(seed=1234, **kw).choices[0].text
    with ThreadPoolExecutor(6) as pool:  # beside other requests, in a different batch
        runs = list(pool.map(lambda s: client.completions.create(seed=s, **kw).choices[0].text,
                             [1234, 99, 1234, 5, 1234, 7]))
    assert runs[0] == runs[2] == runs[4] == first
    assert len({first, runs[1], runs[3], runs[5]}) == 4  # other seeds, other samples
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        seed=1234, stream=True, **kw))
    assert streamed == first


def test_chat_equals_offline_on_the_templated_prompt(server, llm, ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello café 🙂"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1
    want = offline(llm, [ids], max_tokens=25, temperature=0.0, ignore_eos=True)[0]
    client = server.client()
    reply = client.chat.completions.create(model=server_ckpt(server), messages=messages,
                                           max_tokens=25, **GREEDY)
    assert reply.choices[0].message.content == want.text
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(ids)  # one BOS, not two
    chunks = list(client.chat.completions.create(model=server_ckpt(server), messages=messages,
                                                 max_tokens=25, stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text


def test_stop_strings_and_default_max_tokens(server, llm, tmp_path):
    client, model = server.client(), server_ckpt(server)
    prompt = text_prompt(11, 10)
    full = offline(llm, [prompt], max_tokens=40, temperature=0.0, ignore_eos=True)[0].text
    # A stop string of two ASCII characters from the second half of the greedy text.
    at = next(i for i in range(len(full) // 2, len(full) - 1) if full[i:i + 2].isascii()
              and full[i:i + 2].strip() == full[i:i + 2])
    stop = full[at:at + 2]
    cut = full[:full.index(stop)]
    for stream in (False, True):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=40, stop=[stop],
                                        stream=stream, **GREEDY)
        if stream:
            chunks = [c for c in out if c.choices]
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = out.choices[0].text, out.choices[0].finish_reason
        assert (text, reason) == (cut, "stop")
    # No max_tokens: the room left in max_model_len (256 - prompt tokens).
    ids = list(range(5, 235))
    out = client.completions.create(model=model, prompt=ids, **GREEDY)
    assert out.usage.completion_tokens == 256 - len(ids)
    assert out.choices[0].finish_reason == "length"


def test_logprobs_match_the_offline_logits(server, llm, ckpt):
    """Sampled at temperature 2 (so some tokens are not the argmax): each token's logprob
    and its top-2 equal log_softmax of the offline engine's logits at that position."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    client, model = server.client(), server_ckpt(server)
    ids, k, new = [7, 50, 200, 3, 99, 120], 2, 12
    kw = dict(max_tokens=new, temperature=2.0, seed=3)
    sampled = offline(llm, [ids], ignore_eos=True, **kw)[0].token_ids  # same seed, same tokens
    logits = llm.prompt_logits([ids + sampled[:-1]])[0][len(ids) - 1:].double()
    ref = torch.log_softmax(logits, -1)
    assert any(int(ref[i].argmax()) != t for i, t in enumerate(sampled))
    for stream in (False, True):
        out = client.completions.create(model=model, prompt=ids, logprobs=k, stream=stream,
                                        extra_body={"ignore_eos": True}, **kw)
        if stream:
            parts = [c.choices[0].logprobs for c in out if c.choices and c.choices[0].logprobs]
            tokens = [t for p in parts for t in p.tokens]
            token_lps = [x for p in parts for x in p.token_logprobs]
            tops = [x for p in parts for x in p.top_logprobs]
        else:
            lp = out.choices[0].logprobs
            tokens, token_lps, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
        assert tokens == [tok.decode([t]) for t in sampled]
        for i, t in enumerate(sampled):
            assert token_lps[i] == pytest.approx(float(ref[i, t]), abs=1e-4)
            assert sorted(tops[i].values(), reverse=True) == pytest.approx(
                torch.topk(ref[i], k).values.tolist(), abs=1e-4)


def test_a_repeated_prompt_reports_its_cached_tokens(server, llm):
    """Prefix caching is on by default: the second identical prompt is served from the
    cache (whole blocks of 4, at least one prompt token computed), with the same text."""
    client, model = server.client(), str(server_ckpt(server))
    prompt = text_prompt(11, 50)
    before = server.metrics()
    first, second = (client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                               **GREEDY) for _ in range(2))
    assert first.choices[0].text == second.choices[0].text
    n = second.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 4 * 4 > 0
    assert first.usage.prompt_tokens_details.cached_tokens < n - 4  # nothing of its own yet
    after = server.metrics()
    hits = after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0)
    assert hits >= (n - 1) // 4 * 4
    chunks = [list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=4,
        stream=True, stream_options={"include_usage": True}, **GREEDY)) for _ in range(2)]
    assert chunks[1][-1].usage.prompt_tokens_details.cached_tokens > 0


def test_bad_requests_get_400_and_the_server_keeps_serving(server):
    client, model = server.client(), server_ckpt(server)
    bad = [dict(model="no-such-model", prompt="hi"),
           dict(model=model, prompt="hi", max_tokens=10_000),
           dict(model=model, prompt=list(range(1, 300))),
           dict(model=model, prompt="hi", temperature=-0.5),
           dict(model=model, prompt="hi", top_p=0.0),
           dict(model=model, prompt="hi", extra_body={"guided_regex": "a+"}),
           dict(model=model, prompt="hi", extra_body={"top_k": -5}),
           dict(model=model, prompt="hi", logit_bias={"5": 10})]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**kw)
        err = info.value.body
        assert set(err) >= {"message", "type", "param", "code"} and err["message"], kw
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert client.completions.create(model=model, prompt="hi", max_tokens=3).usage
    assert server.proc.poll() is None


def test_disconnect_frees_the_request(server):
    before = server.metrics()["vllm:generation_tokens_total"]
    body = {"model": server_ckpt(server), "prompt": text_prompt(3, 40), "max_tokens": 200,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk arrived: the request is running; now hang up
    deadline = time.monotonic() + 20
    while True:
        m = server.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            break
        assert time.monotonic() < deadline, f"the request still runs after the disconnect: {m}"
        time.sleep(0.05)
    assert m["vllm:generation_tokens_total"] - before < 200  # it did not run to the end


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return found


@pytest.mark.parametrize("engine", [["--no-engine-process"], []],
                         ids=["engine-thread", "engine-process"])
def test_api_key_queue_limit_and_sigterm(ckpt, tmp_path, engine):
    # max_model_len 1024 here: a 1000-token request runs long enough to be seen running.
    env = dict(os.environ, CHUNKLOCAL_API_KEY="sekret-key")
    s = Server(ckpt, tmp_path, ["--max-model-len", "1024", "--max-num-seqs", "1",
                                "--max-waiting-requests", "1", *engine], env=env)
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        assert httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi"}).status_code == 401
        client = s.client(api_key="sekret-key")
        model = client.models.list().data[0].id
        body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 1000, "stream": True,
                "ignore_eos": True}
        headers = {"Authorization": "Bearer sekret-key"}
        results: dict = {}

        def stream(name):
            with httpx.stream("POST", f"{s.url}/v1/completions", json=body, headers=headers,
                              timeout=120) as r:
                results[name] = (r.status_code, [json.loads(x[6:]) for x in r.iter_lines()
                                                 if x.startswith("data: {")])

        def wait_for(name, value):
            deadline = time.monotonic() + 60
            while s.metrics().get(name, 0) < value:
                assert time.monotonic() < deadline, (name, results)
                time.sleep(0.02)

        running = threading.Thread(target=stream, args=("running",))
        running.start()
        wait_for("vllm:num_requests_running", 1)
        waiting = threading.Thread(target=stream, args=("waiting",))
        waiting.start()
        wait_for("vllm:num_requests_waiting", 1)
        with pytest.raises(openai.APIStatusError) as info:  # the queue is full: 503 at once
            client.completions.create(model=model, prompt="hi", max_tokens=2)
        assert info.value.status_code == 503
        children = _children(s.proc.pid)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0
        deadline = time.monotonic() + 10  # children exit once the server has (the
        while time.monotonic() < deadline:  # engine process's resource tracker follows it)
            left = [pid for pid in children if _alive(pid)]
            if not left:
                break
            time.sleep(0.1)
        assert not left
        running.join(30)
        waiting.join(30)
        for name in ("running", "waiting"):
            status, chunks = results[name]
            assert status == 200
            assert chunks[-1]["choices"][0]["finish_reason"] == "abort", (name, chunks[-1])
        assert "".join(c["choices"][0]["text"] for c in results["running"][1])  # it ran
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{s.url}/health", timeout=2)
    finally:
        s.stop()


def _alive(pid: int) -> bool:
    """A process that has not exited (a zombie has: its state is Z)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_load_test_script_against_the_server(server, tmp_path):
    """benchmarks/serve.py --smoke: every request completes with its full output, streamed
    texts equal non-streamed ones, and the server's metrics saw the traffic (3 warm-up
    requests beside the levels' 2 x 8, which the rows do not count)."""
    from benchmarks import serve

    before = server.metrics()
    assert serve.main(["--url", server.url, "--smoke", "--warmup-requests", "3",
                       "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "serve_smoke.json").read_text())
    assert data["errors"] == []
    assert [(r["clients"], r["completed"], r["failed"]) for r in data["rows"]] == [(1, 8, 0),
                                                                                  (4, 8, 0)]
    # Smoke prompts (40 tokens) have 2 cacheable blocks: each level's prompts are its own, so
    # the prefix cache served none of them (one shared set made level 2 all hits).
    assert [r["cached_prompt_tokens"] for r in data["rows"]] == [0, 0]
    assert all(r["itl_p50_ms"] <= r["itl_p90_ms"] <= r["itl_p99_ms"] <= r["itl_max_ms"]
               and (r["itl_over_2x_p50"] > 0) == (r["itl_max_ms"] > 2 * r["itl_p50_ms"])
               for r in data["rows"])
    assert all(r["chunk_gap_p50_ms"] <= r["chunk_gap_p99_ms"]
               and 0 <= r["multi_token_chunks"] <= 1 for r in data["rows"])
    after = server.metrics()
    assert after["vllm:generation_tokens_total"] - before[
        "vllm:generation_tokens_total"] >= (3 + 2 * 8) * 8  # the warm-up's 3 untimed
    assert after["vllm:time_to_first_token_seconds_count"] - before[
        "vllm:time_to_first_token_seconds_count"] == 3 + 16 + 2 * 4  # + --verify 4 a level


def test_load_test_script_with_random_range_ratio(server, tmp_path):
    """benchmarks/serve.py --smoke --random-range-ratio 0.5: prompts of 20..60 tokens, each
    request asking its own max_tokens of 4..12 (vLLM's interval); every request completes
    with its own, streamed and re-sent (--verify 8: every record), the server generated
    exactly those tokens, and each row's throughput is their sum."""
    from types import SimpleNamespace

    from benchmarks import serve

    before = server.metrics()
    assert serve.main(["--url", server.url, "--smoke", "--random-range-ratio", "0.5",
                       "--verify", "8", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "serve_smoke.json").read_text())
    assert data["errors"] == [] and data["config"]["random_range_ratio"] == 0.5
    drawn = {}
    for clients in (1, 4):
        ns = SimpleNamespace(seed=0, random_range_ratio=0.5, prompt_tokens=40, max_tokens=8,
                             max_token_id=255)  # --smoke's lengths
        prompts, max_tokens = serve.prompt_set(ns, f"server {clients}", 8)
        assert len({len(p) for p in prompts}) > 1 and len(set(max_tokens)) > 1
        drawn[clients] = max_tokens
    rows = data["rows"]
    assert [(r["clients"], r["completed"], r["failed"]) for r in rows] == [(1, 8, 0), (4, 8, 0)]
    for r in rows:
        assert r["output_tokens_per_s"] * r["wall_s"] == pytest.approx(sum(drawn[r["clients"]]))
    after = server.metrics()
    assert after["vllm:generation_tokens_total"] - before[
        "vllm:generation_tokens_total"] == 2 * (sum(drawn[1]) + sum(drawn[4]))  # + --verify


def test_closed_loop_floor_completes_every_request_with_the_offline_tokens(llm):
    """benchmarks/serve.py's in-process closed loop (the clients' arrival pattern without
    HTTP): every request once, each with the tokens the offline engine gives it alone."""
    from benchmarks import serve

    prompts = [[(5 * i + j) % 200 + 3 for j in range(6 + i % 5)] for i in range(9)]
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    seen, real = {}, llm.generate

    def spy(batch, *a, **k):
        outs = real(batch, *a, **k)
        seen[tuple(batch[0])] = outs[0].outputs[0].token_ids
        return outs

    llm.generate = spy
    try:
        row = serve.closed_loop(llm, prompts, params, clients=3)
    finally:
        del llm.generate
    assert (row["completed"], row["failed"], row["requests"]) == (9, 0, 9)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert seen == {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    assert row["output_tokens_per_s"] == 9 * 7 / row["wall_s"]
    assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] < 1e3 * row["wall_s"]
    assert 0 < row["tpot_p50_ms"] < 1e3 * row["wall_s"]


def test_offline_waves_run_the_level_s_concurrency(llm):
    """benchmarks/serve.py's offline floor per client level: the prompts in waves of that
    many, each wave one generate() call (9 prompts, 4 clients: waves of 4, 4, 1), every
    request complete."""
    from benchmarks import serve

    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + i % 4)] for i in range(9)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    sizes, real = [], llm.generate

    def spy(batch, *a, **k):
        sizes.append(len(batch))
        return real(batch, *a, **k)

    llm.generate = spy
    try:
        row = serve.waves(llm, prompts, params, clients=4)
    finally:
        del llm.generate
    assert sizes == [4, 4, 1]
    assert (row["completed"], row["failed"], row["clients"]) == (
        9, 0, "4, offline in waves of 4")
