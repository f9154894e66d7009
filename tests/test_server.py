"""The OpenAI-compatible server against a real uvicorn on 127.0.0.1 (replies equal to greedy `generate`, streaming,
log-probabilities, every malformed request a 4xx, 413, the server up after each; issue 43's hardening: a client that
leaves frees its slot, Host, Content-Type and API-key checks, slow heads and bodies cut off, malformed values 400s,
one-line refusals of bad flags; issue 44's parity with vLLM's server: a completion's prompt log-probabilities with
`echo`, scored by lm-eval's `local-completions` as by our in-process adapter, `stream_options.include_usage`,
Prometheus `/metrics`, a base model served for completions only, every field not implemented a 400 naming it, and
the `openai` client's view of all that), the client's retries, timeout, cache and one-line errors against a fake
server, that the client loads no server framework, and lm-eval's `local-chat-completions` model against ours."""
import json
import os
import queue
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import anyio
import httpx
import pytest
import torch

from chat_models import BASE, TOK, base_checkpoint, chat_checkpoint
from conftest import OK

from openpretrain.__main__ import main as cli
from openpretrain.models.common import generate
from openpretrain.chat import END, chat_ids, render
from openpretrain.engine import ChatModel
from openpretrain.posttrain.client import ChatClient, ChatError
from openpretrain.posttrain.server import Admission, BadRequest, ServeConfig, app, serving
HELLO = [{"role": "user", "content": "Übersetze ins Rumantsch: Alle Menschen sind frei."}]
NAME = "openpretrain"
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    "A verified chat checkpoint (a random 2-layer base grown by the four markers) with its tokenizer.json above it."
    return chat_checkpoint(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def served(checkpoint):
    return ChatModel.load(checkpoint)


@pytest.fixture(scope="module")
def url(served):
    "Our server under uvicorn on a free port, stopped after the module's tests whatever happened."
    with serving(app(served, ServeConfig(max_body_bytes=20_000, max_tokens=64, max_concurrency=2))) as base_url:
        yield base_url
    port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1)


def greedy(served, ids: list[int], n: int, end: int | None) -> str:
    "The reply chapter 05a's generate gives: n greedy ids, cut before the first `end`."
    new = generate(served.model, torch.tensor([ids]), min(n, 128 - len(ids)), eos_id=end)[0, len(ids):].tolist()
    return TOK.tok.decode(new[:new.index(end)] if end in new else new)


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", json={"model": NAME, "messages": HELLO, **body}, timeout=30)


def test_a_chat_completion_is_the_templates_greedy_reply(url, served):
    answer = chat(url, temperature=0, max_tokens=24).json()
    ids = render(TOK, HELLO, add_generation_prompt=True)[0]
    assert answer["object"] == "chat.completion" and answer["model"] == NAME
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": greedy(served, ids, 24, chat_ids(TOK)[END])}
    assert answer["choices"][0]["finish_reason"] in ("stop", "length") and answer["usage"]["prompt_tokens"] == len(ids)


def test_a_completion_continues_the_prompt_after_its_bos(url, served):
    answer = httpx.post(f"{url}/completions", json={"model": NAME, "prompt": "Alle Menschen", "temperature": 0,
                                                    "max_tokens": 10}, timeout=30).json()
    ids = [TOK.bos_id, *TOK.encode("Alle Menschen")]
    assert answer["object"] == "text_completion" and answer["choices"][0]["text"] == greedy(served, ids, 10, TOK.eos_id)


def test_streamed_chunks_reassemble_to_the_greedy_reply(url):
    with httpx.stream("POST", f"{url}/chat/completions", timeout=30,
                      json={"model": NAME, "messages": HELLO, "temperature": 0, "max_tokens": 24, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == chat(url, temperature=0, max_tokens=24).json()["choices"][0]["message"]["content"] and text


def test_temperature_zero_is_deterministic_and_a_seed_repeats_a_sample(url):
    text = lambda **s: chat(url, max_tokens=16, **s).json()["choices"][0]["message"]["content"]
    assert text(temperature=0) == text(temperature=0)
    assert text(temperature=1.0, seed=7) == text(temperature=1.0, seed=7)
    assert text(temperature=1.0, top_p=0.9, seed=7) != text(temperature=0)   # a random model's samples are not its arg-max


def test_logprobs_are_the_models_log_softmax_in_openai_format(url, served):
    answer = chat(url, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3).json()
    entries = answer["choices"][0]["logprobs"]["content"]
    ids = render(TOK, HELLO, add_generation_prompt=True)[0]
    with torch.no_grad():
        logp = torch.log_softmax(served.model(torch.tensor([ids]))[0, -1], -1)   # the first reply token's distribution
    top = logp.topk(3)
    assert [t["token"] for t in entries[0]["top_logprobs"]] == [TOK.tok.decode([int(i)]) for i in top.indices]
    assert entries[0]["token"] == entries[0]["top_logprobs"][0]["token"], "greedy takes the most likely token"
    assert entries[0]["logprob"] == pytest.approx(float(top.values[0]), abs=1e-5)
    assert entries[0]["bytes"] == list(entries[0]["token"].encode()) and len(entries) == answer["usage"]["completion_tokens"]


MALFORMED = [  # (body, status, error param)
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"model": NAME}).encode(), 400, "messages"),
    (json.dumps({"model": NAME, "messages": []}).encode(), 400, "messages"),
    (json.dumps({"model": NAME, "messages": [{"role": "tool", "content": "x"}]}).encode(), 400, "messages"),
    (json.dumps({"model": NAME, "messages": [{"role": "user", "content": 3}]}).encode(), 400, "messages"),
    (json.dumps({"model": NAME, "messages": HELLO, "n": 2}).encode(), 400, "n"),
    (json.dumps({"model": NAME, "messages": HELLO, "max_tokens": -1}).encode(), 400, "max_tokens"),
    (json.dumps({"model": NAME, "messages": HELLO, "max_tokens": 65}).encode(), 400, "max_tokens"),
    (json.dumps({"model": NAME, "messages": HELLO, "max_tokens": "8"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": NAME, "messages": HELLO, "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"model": NAME, "messages": HELLO, "top_p": 2}).encode(), 400, "top_p"),
    (json.dumps({"model": NAME, "messages": HELLO, "stop": [1]}).encode(), 400, "stop"),
    (json.dumps({"model": NAME, "messages": HELLO, "top_logprobs": 5}).encode(), 400, "top_logprobs"),
    (json.dumps({"model": "gpt-4o", "messages": HELLO}).encode(), 404, "model"),
    (json.dumps({"messages": HELLO}).encode(), 404, "model"),
    (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "Wort " * 300}]}).encode(), 400, "messages"),
]


@pytest.mark.parametrize("body,status,param", MALFORMED, ids=[f"{i}-{s}-{p}" for i, (_, s, p) in enumerate(MALFORMED)])
def test_a_malformed_request_gets_its_4xx_and_the_server_stays_up(url, body, status, param):
    r = httpx.post(f"{url}/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=30)
    error = r.json()["error"]
    assert r.status_code == status and error["param"] == param and error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    assert httpx.get(url.removesuffix("/v1") + "/health", timeout=5).json() == {"status": "ok"}


def test_completions_refuse_a_malformed_prompt_and_chats_logprobs(url):
    for body, param in (({"prompt": 3}, "prompt"), ({"prompt": [[1, 2], []]}, "prompt"), ({"prompt": [2048, 99999]}, "prompt"),
                        ({"prompt": ["a"] * 17}, "prompt"), ({"prompt": "a", "logprobs": True}, "logprobs"),
                        ({"prompt": ["a", "b"], "stream": True}, "prompt")):
        r = httpx.post(f"{url}/completions", json={"model": NAME, **body}, timeout=30)
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), body


def test_an_oversize_body_is_413_whether_announced_or_chunked(url):
    big = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x" * 30_000}]}).encode()
    assert httpx.post(f"{url}/chat/completions", content=big, headers=JSON, timeout=30).status_code == 413
    chunked = httpx.post(f"{url}/chat/completions", content=iter([big[:15_000], big[15_000:]]), headers=JSON, timeout=30)
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    assert httpx.get(url.removesuffix("/v1") + "/health", timeout=5).status_code == 200


def test_a_reply_stops_at_the_context_with_finish_reason_length(url):
    long = [{"role": "user", "content": "Wort " * 55}]
    prompt = len(render(TOK, long, add_generation_prompt=True)[0])
    answer = chat(url, messages=long, temperature=0, max_tokens=64).json()
    assert prompt + 64 > 128 and answer["choices"][0]["finish_reason"] in ("length", "stop")
    assert answer["usage"]["completion_tokens"] <= 128 - prompt


def test_models_and_unknown_routes(url):
    assert [m["id"] for m in httpx.get(f"{url}/models").json()["data"]] == [NAME]
    assert httpx.get(f"{url}/nowhere").json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/chat/completions").status_code == 405


class Gated(torch.nn.Module):
    "A model whose every forward waits for `go`, so that a test can hold a request in the middle of its decoding."
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.started, self.go = inner, threading.Event(), threading.Event()
        self.config = inner.config                                     # the engine reads the context from it

    def init_cache(self, *args, **kwargs):
        return self.inner.init_cache(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self.started.set()
        self.go.wait(30)
        return self.inner(*args, **kwargs)


def test_a_request_beyond_the_slot_and_queue_is_503_and_the_server_stays_up(served):
    gated = Gated(served.model)
    with serving(app(ChatModel(gated, served.tokenizer, served.name),
                     ServeConfig(max_concurrency=1, max_queue=0, max_tokens=8))) as base_url:
        try:
            first = ThreadPoolExecutor(1).submit(chat, base_url, temperature=0, max_tokens=4)
            assert gated.started.wait(30), "the first request never reached the model"
            second = chat(base_url, temperature=0, max_tokens=4)          # while the first holds the only slot
        finally:
            gated.go.set()
        error = second.json()["error"]
        assert second.status_code == 503 and (error["type"], error["code"], error["param"]) == ("server_error", "busy", None)
        assert "busy" in error["message"] and first.result(30).status_code == 200
        assert chat(base_url, temperature=0, max_tokens=4).status_code == 200   # the slot is free again
        assert httpx.get(base_url.removesuffix("/v1") + "/health", timeout=5).json() == {"status": "ok"}


def test_a_request_cancelled_in_the_queue_gives_its_place_back():
    async def scenario() -> int:
        admission = Admission(1, 1)
        admission.admit()
        await admission.acquire()                                 # the first request decodes
        admission.admit()                                         # the second waits in the queue ...
        with anyio.move_on_after(0.05):
            await admission.acquire()                             # ... and is cancelled there
        admission.admit()                                         # so a third finds its place
        with pytest.raises(BadRequest, match="busy"):
            admission.admit()                                     # and a fourth none
        return admission.admitted
    assert anyio.run(scenario) == 2


# ---- hardening: clients that leave, foreign pages and slow clients, malformed values (issue 43) --------------------

def port_of(base_url: str) -> int:
    return int(base_url.rsplit(":", 1)[1].split("/")[0])


def raw_request(port: int, path: str, body: bytes, host: str | None = None) -> socket.socket:
    "A socket that has sent one whole POST of `body` as JSON, its answer not read."
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
              % (path.encode(), (host or f"127.0.0.1:{port}").encode(), len(body), body))
    return s


def read_until_closed(s: socket.socket, seconds: float = 10) -> bytes:
    "Everything the server sends until it closes the connection, within `seconds`."
    s.settimeout(seconds)
    data, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
    return data


class Slow(torch.nn.Module):
    "A model whose every forward takes `delay` s more and is counted, so that a test can see decoding go on or stop."
    def __init__(self, inner: torch.nn.Module, delay: float):
        super().__init__()
        self.inner, self.delay, self.calls = inner, delay, 0
        self.config = inner.config

    def init_cache(self, *args, **kwargs):
        return self.inner.init_cache(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self.calls += 1
        time.sleep(self.delay)
        return self.inner(*args, **kwargs)


def wait_for(condition, seconds: float = 10) -> bool:
    "Poll `condition` every 20 ms for at most `seconds`."
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_client_that_leaves_stops_its_reply_and_frees_the_slot(served):
    slow = Slow(served.model, 0.05)                                # 64 steps: 3 s and more of decoding
    web = app(ChatModel(slow, served.tokenizer, served.name), ServeConfig(max_concurrency=1, max_queue=0, max_tokens=64))
    with serving(web) as base_url:
        body = json.dumps({"model": NAME, "messages": HELLO, "temperature": 0, "max_tokens": 64}).encode()
        client = raw_request(port_of(base_url), "/v1/chat/completions", body)
        assert wait_for(lambda: slow.calls >= 3), "the reply never started decoding"
        client.close()                                              # the client leaves, its reply not read
        at_leaving = slow.calls
        assert wait_for(lambda: web.state.admission.admitted == 0, 5), "the slot was not given back"
        time.sleep(0.5)
        assert slow.calls - at_leaving <= 4, f"{slow.calls - at_leaving} more steps decoded for nobody"
        t0 = time.monotonic()
        assert chat(base_url, temperature=0, max_tokens=2).status_code == 200
        assert time.monotonic() - t0 < 5


def test_a_client_that_leaves_a_stream_stops_it_and_frees_the_slot(served):
    slow = Slow(served.model, 0.05)
    web = app(ChatModel(slow, served.tokenizer, served.name), ServeConfig(max_concurrency=1, max_queue=0, max_tokens=64))
    with serving(web) as base_url:
        body = json.dumps({"model": NAME, "messages": HELLO, "temperature": 0, "max_tokens": 64, "stream": True}).encode()
        client = raw_request(port_of(base_url), "/v1/chat/completions", body)
        assert client.recv(4096).startswith(b"HTTP/1.1 200") and wait_for(lambda: slow.calls >= 3)
        client.close()
        at_leaving = slow.calls
        assert wait_for(lambda: web.state.admission.admitted == 0, 5), "the slot was not given back"
        time.sleep(0.5)
        assert slow.calls - at_leaving <= 4, f"{slow.calls - at_leaving} more steps decoded for nobody"

def test_a_client_that_leaves_the_queue_gives_its_place_back(served):
    gated = Gated(served.model)
    web = app(ChatModel(gated, served.tokenizer, served.name), ServeConfig(max_concurrency=1, max_queue=1, max_tokens=8))
    with serving(web) as base_url:
        try:
            first = ThreadPoolExecutor(1).submit(chat, base_url, temperature=0, max_tokens=2)
            assert gated.started.wait(30), "the first request never reached the model"
            body = json.dumps({"model": NAME, "messages": HELLO, "max_tokens": 2}).encode()
            queued = raw_request(port_of(base_url), "/v1/chat/completions", body)
            assert wait_for(lambda: web.state.admission.admitted == 2), "the second request was not queued"
            queued.close()                                          # it leaves while it waits for the slot
            assert wait_for(lambda: web.state.admission.admitted == 1, 5), "the place in the queue stayed taken"
        finally:
            gated.go.set()
        assert first.result(30).status_code == 200 and wait_for(lambda: web.state.admission.admitted == 0, 5)


def test_a_stream_abandoned_before_its_first_chunk_gives_its_slot_back(served):
    "The client leaves while the response head is written: the events never start, the slot must still come back."
    web = app(served, ServeConfig(max_concurrency=1, max_queue=0, max_tokens=8))
    body = json.dumps({"model": NAME, "messages": HELLO, "max_tokens": 4, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "root_path": "",
             "query_string": b"", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
             "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}

    async def scenario():
        left, sent, messages = anyio.Event(), [], [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message["type"])
            if message["type"] == "http.response.start":
                left.set()                                       # the client leaves ...
                await anyio.sleep(10)                            # ... while the head is still being written

        with anyio.fail_after(20):
            await web(scope, receive, send)
        return sent, web.state.admission.admitted, web.state.admission.slots.value

    assert anyio.run(scenario) == (["http.response.start"], 0, 1)


def test_a_post_that_is_not_json_is_415(url):
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"content-type": kind} if kind else {}
        r = httpx.post(f"{url}/chat/completions", content=json.dumps({"model": NAME, "messages": HELLO}),
                       headers=headers, timeout=30)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (kind, r.text)
    assert chat(url, max_tokens=1).status_code == 200                      # application/json; charset=... is fine


def test_a_host_header_that_is_not_this_server_is_refused(url):
    port, root = port_of(url), url.removesuffix("/v1")
    for host, status in ((f"rebound.example:{port}", 421), (f"127.0.0.1:{port + 1}", 421), ("localhost", 421),
                         (f"localhost:{port}", 200), (f"127.0.0.1:{port}", 200)):
        r = httpx.get(f"{root}/health", headers={"host": host}, timeout=5)
        assert r.status_code == status, (host, r.text)
        assert status == 200 or r.json()["error"]["code"] == "misdirected_request"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:      # HTTP/1.0 may leave Host out; we may not
        s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        answer = read_until_closed(s, 5)
    assert answer.startswith(b"HTTP/1.1 400") and json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "invalid_host"


def test_an_api_key_is_required_when_one_is_set(served):
    with serving(app(served, ServeConfig(api_key="sekrit", max_tokens=4))) as base_url:
        for auth in (None, "Bearer wrong", "sekrit", "Bearer sekrit2"):
            r = httpx.get(f"{base_url}/models", headers={"authorization": auth} if auth else {}, timeout=5)
            error = r.json()["error"]
            assert (r.status_code, error["code"], error["type"]) == (401, "invalid_api_key", "invalid_request_error")
            assert r.headers["www-authenticate"] == "Bearer"
        key = {"authorization": "Bearer sekrit"}
        assert httpx.get(f"{base_url}/models", headers=key, timeout=5).json()["data"][0]["id"] == NAME
        r = httpx.post(f"{base_url}/chat/completions", json={"model": NAME, "messages": HELLO, "max_tokens": 2},
                       headers=key, timeout=30)
        assert r.status_code == 200
        assert httpx.get(base_url.removesuffix("/v1") + "/health", timeout=5).status_code == 200   # no key needed
        assert ChatClient(base_url, api_key="sekrit", retries=0).chat(HELLO, max_tokens=2).finish_reason in ("stop", "length")
        with pytest.raises(ChatError, match="HTTP 401"):
            ChatClient(base_url, retries=0).chat(HELLO, max_tokens=2)


def test_a_body_that_drips_is_cut_off_with_408(served):
    with serving(app(served, ServeConfig(body_timeout_s=1.0))) as base_url:
        port = port_of(base_url)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{" % port)
            t0, answered = time.monotonic(), False
            for _ in range(40):                                          # a byte every 0.25 s, 10 s at most
                if select.select([s], [], [], 0.25)[0]:
                    answered = True
                    break
                s.sendall(b" ")
            answer, elapsed = read_until_closed(s, 5), time.monotonic() - t0
        assert answered and elapsed < 4, f"no answer {elapsed:.1f} s into a dripping body"
        assert answer.startswith(b"HTTP/1.1 408") and b"connection: close" in answer.lower()
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        assert httpx.get(base_url.removesuffix("/v1") + "/health", timeout=5).status_code == 200


def closed(s: socket.socket) -> bool:
    "Whether the server has closed `s` (it sends nothing else to a request head that never ends)."
    if not select.select([s], [], [], 0)[0]:
        return False
    try:
        return s.recv(1) == b""
    except OSError:
        return True


def _drip(s: socket.socket) -> bool:
    try:
        s.sendall(b"X-Drip: 1\r\n")
        return True
    except OSError:
        return False


def test_dripping_request_heads_are_cut_off_and_health_answers(served):
    "24 connections that send a header line every 0.2 s hold more than the 16 connections allowed: for a second only."
    c = ServeConfig(head_timeout_s=1.0, max_connections=16)
    with serving(app(served, c)) as base_url:
        port, health = port_of(base_url), base_url.removesuffix("/v1") + "/health"
        drips = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(24)]
        try:
            for s in drips:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            t0, cut, healthy = time.monotonic(), set(), None
            while time.monotonic() - t0 < 10 and (len(cut) < len(drips) or healthy is None):
                for i, s in enumerate(drips):
                    if i not in cut and (closed(s) or not _drip(s)):
                        cut.add(i)
                if healthy is None:
                    try:
                        healthy = time.monotonic() - t0 if httpx.get(health, timeout=1).status_code == 200 else None
                    except httpx.HTTPError:
                        pass
                time.sleep(0.2)
            elapsed = time.monotonic() - t0
        finally:
            for s in drips:
                s.close()
        assert len(cut) == len(drips), f"{len(drips) - len(cut)} dripping connections still open after {elapsed:.1f} s"
        assert healthy is not None and healthy < c.head_timeout_s + 3, f"/health unanswered for {healthy or elapsed:.1f} s"


BAD_VALUES = [  # (route, raw body, error param)
    ("chat/completions", b'{"model": "openpretrain", "messages": [{"role": "user", "content": "hi"}], "max_tokens": '
     + b"9" * 5000 + b"}", None),
    ("chat/completions", json.dumps({"model": NAME, "messages": HELLO, "seed": 2**64}).encode(), "seed"),
    ("chat/completions", json.dumps({"model": NAME, "messages": HELLO, "seed": -2**70}).encode(), "seed"),
    ("chat/completions", b'{"model": "openpretrain", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    ("chat/completions", b'{"model": "openpretrain", "messages": [{"role": "user", "content": "a\xed\xa0\x80b"}]}', "messages"),
    ("completions", b'{"model": "openpretrain", "prompt": "\\udfff"}', "prompt"),
    ("chat/completions", b"[" * 100_000 + b"]" * 100_000, None),
    ("chat/completions", json.dumps({"model": NAME, "messages": HELLO, "max_tokens": 1}).encode()[:-1]
     + b', "metadata": ' + b"[" * 200 + b"]" * 200 + b"}", "metadata"),      # deep in a field we ignore
    ("chat/completions", b'{"model": "openpretrain", "messages": [{"role": "user", "content": "hi"}], "top_p": NaN}', None),
]


@pytest.fixture(scope="module")
def roomy_url(served):
    "Our server with the default 1 MiB body bound, which a body nested 100,000 deep fits."
    with serving(app(served, ServeConfig(max_tokens=64))) as base_url:
        yield base_url


@pytest.mark.parametrize("route,body,param", BAD_VALUES,
                         ids=["5000-digits", "seed-2^64", "seed--2^70", "escaped-surrogate", "raw-surrogate",
                              "prompt-surrogate", "nested-100000", "nested-200", "NaN"])
def test_a_malformed_value_is_a_400_not_a_500(roomy_url, route, body, param):
    url = roomy_url
    r = httpx.post(f"{url}/{route}", content=body, headers=JSON, timeout=30)
    assert r.status_code == 400, r.text[:200]
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param) and error["message"]
    assert httpx.get(url.removesuffix("/v1") + "/health", timeout=5).json() == {"status": "ok"}


# ---- parity with vLLM's server: prompt log-probabilities, usage chunks, metrics, base models, fields (issue 44) ----

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    "A base model (the random 2-layer model before the chat markers) with its plain 2,048-id tokenizer."
    root = tmp_path_factory.mktemp("base")
    return ChatModel.load(base_checkpoint(root), root / "base.json", require_chat=False)


@pytest.fixture(scope="module")
def base_url(base):
    with serving(app(base, ServeConfig(max_tokens=64, max_concurrency=2))) as base_url:
        yield base_url


def prompt_logprobs(model, ids: list[int]) -> list[float]:
    "Each id's log-probability given the ids before it, from one forward of the model (the first id: none)."
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)     # (T, V)
    return [float(logp[t, i]) for t, i in enumerate(ids[1:])]


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_gives_the_prompts_log_probs_in_the_legacy_format(base_url, base, max_tokens):
    ids = [BASE.bos_id, *BASE.encode("Alle Menschen sind frei und gleich")]
    answer = httpx.post(f"{base_url}/completions", json={"model": NAME, "prompt": ids, "max_tokens": max_tokens, "echo": True,
                                                         "logprobs": 2, "temperature": 0}, timeout=30).json()
    choice, n = answer["choices"][0], answer["usage"]["completion_tokens"]
    lp = choice["logprobs"]
    assert lp["tokens"][:len(ids)] == [BASE.tok.decode([i], skip_special_tokens=False) for i in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None       # nothing predicts the first id
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(prompt_logprobs(base.model, ids), abs=1e-4)
    assert all(len(top) in (2, 3) and top[tok] == p for tok, p, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:],
                                                                            lp["top_logprobs"][1:]))
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:k])) for k in range(len(lp["tokens"]))]
    assert len(lp["tokens"]) == len(ids) + n and n == max_tokens and answer["usage"]["prompt_tokens"] == len(ids)
    assert choice["text"].startswith(BASE.tok.decode(ids)) and choice["finish_reason"] == "length"


def test_lm_evals_local_completions_scores_as_our_in_process_adapter(base_url, base, tmp_path, monkeypatch):
    "lm-eval's own API model sends token ids with echo and logprobs 1; its sums and greedy flags equal OpenPretrainLM's."
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import PreTrainedTokenizerFast

    from openpretrain.evaluation.harness import OpenPretrainLM
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")                                     # the tokenizer is a local folder
    PreTrainedTokenizerFast(tokenizer_object=BASE.tok, bos_token="<s>", eos_token="</s>").save_pretrained(tmp_path / "tok")
    lm = LocalCompletionsAPI(base_url=f"{base_url}/completions", model=NAME, tokenizer_backend="huggingface",
                             tokenizer=str(tmp_path / "tok"), max_length=128, batch_size=2, max_retries=1)
    with torch.no_grad():                                        # the base's own greedy next token after a context
        top = int(base.model(torch.tensor([BASE.encode("Alle Menschen sind")]))[0, -1].argmax())
    pairs = [("Alle Menschen sind frei", " und gleich an Würde"), ("Übersetze ins Rumantsch:", " Tuts umans"),
             ("", "Allegra"), ("Grüezi", " mitenand"), ("Alle Menschen sind", BASE.tok.decode([top]))]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    ours = OpenPretrainLM(base.model, BASE).loglikelihood(requests)
    theirs = lm.loglikelihood(requests, disable_tqdm=True)
    assert [lp for lp, _ in theirs] == pytest.approx([lp for lp, _ in ours], abs=1e-4)
    assert [greedy for _, greedy in theirs] == [greedy for _, greedy in ours] == [False] * 4 + [True]
    assert all(lp < 0 for lp, _ in theirs) and len({round(lp, 3) for lp, _ in theirs}) == len(pairs)


def sse(url: str, body: dict) -> list[dict]:
    "The JSON chunks of a streamed answer, [DONE] checked and left off."
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("route,ask", [("chat/completions", {"messages": HELLO}), ("completions", {"prompt": "Alle Menschen"})])
def test_include_usage_ends_a_stream_with_the_usage_and_no_choices(url, route, ask):
    body = {"model": NAME, **ask, "temperature": 0, "max_tokens": 6}
    chunks = sse(f"{url}/{route}", {**body, "stream": True, "stream_options": {"include_usage": True}})
    whole = httpx.post(f"{url}/{route}", json=body, timeout=30).json()
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks[:-1])
    assert "usage" not in sse(f"{url}/{route}", {**body, "stream": True})[-1]           # not asked: OpenAI's chunks


def metric_values(text: str) -> dict[tuple[str, frozenset], float]:
    "Prometheus's text exposition parsed by hand: (name, its labels) → value; every line a comment or a sample."
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)', line)
        assert m, f"not a sample line: {line!r}"
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m[2] or ""))
        out[m[1], labels] = float(m[3])
    return out


def test_metrics_count_requests_ids_and_latency_and_need_no_api_key(served):
    with serving(app(served, ServeConfig(api_key="sekrit", max_tokens=8))) as base_url:
        page = lambda: httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=5)
        assert page().status_code == 200 and page().headers["content-type"].startswith("text/plain; version=0.0.4")
        before = metric_values(page().text)
        key = {"authorization": "Bearer sekrit"}
        answer = httpx.post(f"{base_url}/chat/completions", json={"model": NAME, "messages": HELLO, "max_tokens": 5,
                                                                  "temperature": 0}, headers=key, timeout=30).json()
        assert httpx.get(f"{base_url}/models", timeout=5).status_code == 401
        httpx.get(base_url.removesuffix("/v1") + "/wp-admin", headers=key, timeout=5)
        after = metric_values(page().text)
    moved = lambda name, **labels: after.get((name, frozenset(labels.items())), 0) - before.get((name, frozenset(labels.items())), 0)
    assert moved("openpretrain_http_requests_total", route="/v1/chat/completions", status="200") == 1
    assert moved("openpretrain_http_requests_total", route="/v1/models", status="401") == 1
    assert moved("openpretrain_http_requests_total", route="other", status="404") == 1        # no series per unknown path
    assert moved("openpretrain_prompt_tokens_total") == answer["usage"]["prompt_tokens"]
    assert moved("openpretrain_generation_tokens_total") == answer["usage"]["completion_tokens"]
    assert moved("openpretrain_http_request_duration_seconds_count", route="/v1/chat/completions") == 1
    assert moved("openpretrain_http_request_duration_seconds_sum", route="/v1/chat/completions") > 0
    assert after["openpretrain_requests_running", frozenset()] == after["openpretrain_requests_waiting", frozenset()] == 0


def test_metrics_show_a_reply_running_and_one_waiting(served):
    gated = Gated(served.model)
    with serving(app(ChatModel(gated, served.tokenizer, served.name), ServeConfig(max_concurrency=1, max_tokens=8))) as base_url:
        gauges = lambda: {k[0]: v for k, v in metric_values(httpx.get(base_url.removesuffix("/v1") + "/metrics",
                                                                       timeout=5).text).items() if k[0].startswith("openpretrain_requests_")}
        pool = ThreadPoolExecutor(2)
        try:
            first = pool.submit(chat, base_url, temperature=0, max_tokens=2)
            assert gated.started.wait(30), "the first request never reached the model"
            second = pool.submit(chat, base_url, temperature=0, max_tokens=2)
            assert wait_for(lambda: gauges() == {"openpretrain_requests_running": 1, "openpretrain_requests_waiting": 1})
        finally:
            gated.go.set()
        assert first.result(30).status_code == second.result(30).status_code == 200
        assert wait_for(lambda: gauges() == {"openpretrain_requests_running": 0, "openpretrain_requests_waiting": 0})


UNSUPPORTED = [  # (route, field, value): refused, the field named in `param`
    ("chat/completions", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("chat/completions", "tool_choice", "auto"), ("chat/completions", "response_format", {"type": "json_object"}),
    ("chat/completions", "functions", [{"name": "f", "parameters": {}}]), ("chat/completions", "logit_bias", {"42": 100}),
    ("chat/completions", "frequency_penalty", 0.5), ("chat/completions", "audio", {"voice": "alloy"}),
    ("chat/completions", "echo", True), ("chat/completions", "prompt", "x"), ("completions", "suffix", "!"),
    ("completions", "best_of", 2), ("completions", "logit_bias", {"42": 100}), ("completions", "top_k", 40),
    ("completions", "messages", HELLO), ("completions", "max_completion_tokens", 4), ("completions", "no_such_field", 1),
]


@pytest.mark.parametrize("route,field,value", UNSUPPORTED, ids=[f"{r.split('/')[0]}-{f}" for r, f, _ in UNSUPPORTED])
def test_a_field_not_implemented_is_a_400_naming_it(url, route, field, value):
    ask = {"messages": HELLO} if route.startswith("chat") else {"prompt": "Alle Menschen"}
    r = httpx.post(f"{url}/{route}", json={"model": NAME, **ask, "max_tokens": 2, field: value}, timeout=30)
    error = r.json()["error"]
    assert (r.status_code, error["param"], error["code"]) == (400, field, "unsupported_parameter") and field in error["message"]


def test_harmless_fields_and_neutral_values_are_taken(url):
    chat_extras = {"user": "u-1", "metadata": {"run": "a"}, "store": False, "n": 1, "seed": 3, "presence_penalty": 0,
                   "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none", "top_k": -1,
                   "response_format": {"type": "text"}, "parallel_tool_calls": True, "stop": ["\n\n"], "functions": None}
    assert chat(url, max_tokens=2, **chat_extras).status_code == 200
    completion_extras = {"user": "u-1", "n": 1, "best_of": 1, "suffix": None, "echo": False, "logprobs": None,
                         "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1.0, "min_p": 0}
    r = httpx.post(f"{url}/completions", json={"model": NAME, "prompt": "a", "max_tokens": 2, **completion_extras}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_base_model_serves_completions_and_refuses_chat_in_400(base_url):
    r = httpx.post(f"{base_url}/chat/completions", json={"model": NAME, "messages": HELLO}, timeout=30)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "no_chat_template") and "chat template" in r.json()["error"]["message"]
    r = httpx.post(f"{base_url}/completions", json={"model": NAME, "prompt": "Alle Menschen", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4


def test_the_openai_client_reads_usage_chunks_log_probs_and_refusals(url, base_url):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=HELLO, max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat(url, temperature=0, max_tokens=6).json()["choices"][0]["message"]["content"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    pieces = list(client.completions.create(model=NAME, prompt="Alle Menschen", max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert pieces[-1].choices == [] and pieces[-1].usage.prompt_tokens == 1 + len(TOK.encode("Alle Menschen"))
    scored = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).completions.create(
        model=NAME, prompt="Alle Menschen", max_tokens=0, echo=True, logprobs=1)
    assert scored.choices[0].logprobs.token_logprobs[0] is None and len(scored.choices[0].logprobs.tokens) >= 2
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=HELLO, tools=[{"type": "function", "function": {"name": "f"}}])
    assert e.value.param == "tools"
    with pytest.raises(openai.BadRequestError, match="chat template"):
        openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).chat.completions.create(model=NAME, messages=HELLO)


def test_the_openai_client_needs_the_api_key(served):
    openai = pytest.importorskip("openai")
    with serving(app(served, ServeConfig(api_key="sekrit", max_tokens=4))) as base_url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
        assert [m.id for m in openai.OpenAI(base_url=base_url, api_key="sekrit", max_retries=0).models.list()] == [NAME]


# ---- the client, against a fake server ---------------------------------------------------------------------------

def test_the_client_imports_no_server_framework():
    probe = "import sys, openpretrain.posttrain.client; print(sorted({'starlette', 'uvicorn', 'torch'} & set(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded == "[]\n", f"importing the client loaded {loaded.strip()}"


def test_the_client_retries_503_twice_with_backoff_then_succeeds(fake):
    base, state = fake
    state["script"] = [(503, {"error": {"message": "busy"}}, 0.0)] * 2 + [(200, OK, 0.0)]
    client = ChatClient(base, retries=3, backoff=0.05)
    t0 = time.perf_counter()
    assert client.chat(HELLO).text == "Allegra"
    assert state["hits"] == 3 == client.requests and time.perf_counter() - t0 >= 0.05 + 0.1   # slept 0.05 then 0.1


def test_the_client_retries_429_and_gives_up_in_one_line(fake):
    base, state = fake
    state["script"] = [(429, {"error": {"message": "slow down"}}, 0.0)]
    with pytest.raises(ChatError, match=r"HTTP 429: slow down \(after 3 attempts\)") as e:
        ChatClient(base, retries=2, backoff=0.0).chat(HELLO)
    assert state["hits"] == 3 and "\n" not in str(e.value)


def test_the_client_does_not_retry_a_400(fake):
    base, state = fake
    state["script"] = [(400, {"error": {"message": "turn 0: bad"}}, 0.0), (200, OK, 0.0)]
    with pytest.raises(ChatError, match="HTTP 400: turn 0: bad"):
        ChatClient(base, retries=3, backoff=0.0).chat(HELLO)
    assert state["hits"] == 1


def test_a_timeout_is_a_clear_error(fake):
    base, state = fake
    state["script"] = [(200, OK, 1.0)]
    with pytest.raises(ChatError, match=r"no answer within 0.2 s \(after 1 attempts\)"):
        ChatClient(base, timeout=0.2, retries=0).chat(HELLO)


def test_a_cache_hit_sends_no_second_request(fake, tmp_path):
    base, state = fake
    client = ChatClient(base, cache_dir=tmp_path)
    assert client.chat(HELLO, temperature=0).text == client.chat(HELLO, temperature=0).text == "Allegra"
    assert state["hits"] == 1
    client.chat(HELLO, temperature=0.5)                        # other sampling settings: another key
    ChatClient(base, model="other", cache_dir=tmp_path).chat(HELLO, temperature=0)   # another model: another key
    assert state["hits"] == 3 and len(list(tmp_path.rglob("*.json"))) == 3


def test_bad_answers_are_one_line_errors_and_never_cached(fake, tmp_path):
    base, state = fake
    for body, message in ((b"<html>oops</html>", "answered non-JSON"), ({"id": "x"}, r"no choices\[0\]\.message\.content")):
        state["script"] = [(200, body, 0.0)]
        with pytest.raises(ChatError, match=message) as e:
            ChatClient(base, retries=0, cache_dir=tmp_path).chat(HELLO)
        assert "\n" not in str(e.value) and base in str(e.value)
    assert not list(tmp_path.rglob("*.json"))


def test_no_server_configured_or_reachable_is_one_line(monkeypatch):
    monkeypatch.delenv("OPENPRETRAIN_CHAT_URL", raising=False)
    with pytest.raises(ChatError, match="no chat server configured"):
        ChatClient()
    with socket.socket() as s:                                 # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ChatError, match=r"unreachable \(ConnectError") as e:
        ChatClient(f"http://127.0.0.1:{port}/v1", retries=1, backoff=0.0).chat(HELLO)
    assert "\n" not in str(e.value)


def test_the_client_against_our_server_batches_and_caches(url, tmp_path):
    client = ChatClient(url, max_concurrency=2, cache_dir=tmp_path)
    asks = [HELLO, [{"role": "user", "content": "Grüezi"}], [{"role": "user", "content": "Allegra"}]]
    replies = client.chat_many(asks, temperature=0, max_tokens=8)
    assert [r.text for r in replies] == [client.chat(m, temperature=0, max_tokens=8).text for m in asks]
    assert client.requests == 3


# ---- lm-eval and the CLI --------------------------------------------------------------------------------------------

def test_lm_evals_local_chat_completions_generates_against_our_server(url):
    from lm_eval.api.instance import Instance
    from lm_eval.models.api_models import JsonChatStr
    from lm_eval.models.openai_completions import LocalChatCompletion

    lm = LocalChatCompletion(base_url=f"{url}/chat/completions", model=NAME, tokenizer_backend=None, max_retries=1)
    asks = [HELLO, [{"role": "user", "content": "Grüezi mitenand"}]]
    requests = [Instance("generate_until", {}, (JsonChatStr(json.dumps(m)), {"until": ["\n\n"], "max_gen_toks": 8}), i)
                for i, m in enumerate(asks)]
    ours = ChatClient(url)
    expected = [ours.chat(m, temperature=0, max_tokens=8, stop=["\n\n"], seed=1234).text for m in asks]
    assert lm.generate_until(requests, disable_tqdm=True) == expected


def test_serve_refuses_a_missing_checkpoint_in_one_line(capsys, tmp_path):
    assert cli(["serve", "--checkpoint", str(tmp_path / "nowhere"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("openpretrain serve: ") and "no such checkpoint folder" in err and err.count("\n") == 1


def test_serving_stops_its_server_even_after_an_error(served):
    with pytest.raises(RuntimeError, match="inside"):
        with serving(app(served)) as base_url:
            port = int(base_url.rsplit(":", 1)[1].split("/")[0])
            assert httpx.get(base_url.removesuffix("/v1") + "/health").status_code == 200
            raise RuntimeError("inside")
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1)


BAD_FLAGS = [  # (flags, what the one line says)
    (["--port", "{busy}"], "Address already in use"),
    (["--host", "999.1.1.1"], "cannot listen on 999.1.1.1"),
    (["--name", ""], "serve.name: must be a non-empty"),
    (["--max-tokens", str(10**23)], "serve.max_tokens"),
    (["--max-tokens", "10^23"], "argument --max-tokens: invalid int value"),
    (["--api-key", ""], "serve.api_key"),
]


@pytest.mark.parametrize("flags,says", BAD_FLAGS, ids=["port-in-use", "bad-host", "empty-name", "max-tokens-1e23",
                                                      "max-tokens-not-int", "empty-api-key"])
def test_serve_refuses_a_bad_flag_in_one_line(capsys, tmp_path, flags, says):
    with socket.socket() as busy:                              # a port another server listens on
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        flags = [f.format(busy=busy.getsockname()[1]) for f in flags]
        assert cli(["serve", "--checkpoint", str(tmp_path / "nowhere"), "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("openpretrain serve: ") and says in err and err.count("\n") == 1, err


@contextmanager
def cli_server(*flags: str, env: dict | None = None) -> Iterator[tuple[str, str]]:
    "`openpretrain serve … --port 0` in a subprocess: (its base URL, the line that announced it), stopped on exit."
    proc = subprocess.Popen([sys.executable, "-m", "openpretrain", "serve", *flags, "--port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    lines = queue.Queue()
    threading.Thread(target=lambda: [*map(lines.put, proc.stderr), lines.put("")], daemon=True).start()   # "": it ended
    try:
        announced = None
        for _ in range(50):                                    # the announcement is among the first lines
            line = lines.get(timeout=60)
            if not line or (announced := re.search(r"^openpretrain serve: \S+ on http://127\.0\.0\.1:(\d+)/v1", line)):
                break
        assert announced and int(announced[1]) != 0, "serve announced no port"
        base_url = f"http://127.0.0.1:{int(announced[1])}/v1"
        assert wait_for(lambda: _up(base_url), 60), f"nothing answers at {base_url}"
        yield base_url, line
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_serve_announces_the_port_it_bound_and_reads_its_api_key_from_the_environment(checkpoint):
    with cli_server("--checkpoint", str(checkpoint), env={"OPENPRETRAIN_API_KEY": "sekrit"}) as (base_url, line):
        assert "API key required" in line and "base model" not in line
        assert httpx.get(f"{base_url}/models", timeout=5).status_code == 401
        assert httpx.get(f"{base_url}/models", headers={"authorization": "Bearer sekrit"}, timeout=5).status_code == 200


def test_serve_serves_a_base_checkpoint_with_its_plain_tokenizer(tmp_path):
    ckpt = base_checkpoint(tmp_path)
    with cli_server("--checkpoint", str(ckpt), "--tokenizer", str(tmp_path / "base.json")) as (base_url, line):
        assert "a base model: /v1/completions only" in line
        r = httpx.post(f"{base_url}/chat/completions", json={"model": NAME, "messages": HELLO}, timeout=30)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "no_chat_template")
        r = httpx.post(f"{base_url}/completions", json={"model": NAME, "prompt": "Alle", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["object"] == "text_completion"


def _up(base_url: str) -> bool:
    try:
        return httpx.get(base_url.removesuffix("/v1") + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
