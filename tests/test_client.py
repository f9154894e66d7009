"""`ChatClient` against servers that misbehave (issue 43, cause 5), each a fake on 127.0.0.1 that the test starts and
stops: malformed 200s and error bodies are one-line ChatErrors naming the server, a trickled reply is cut at the
deadline, an oversized one is refused without being read whole, a request the server took is not sent again, bad
settings are refused when the client is made, and a bad or unwritable cache never costs the reply."""
import errno
import json
import math
import os
import time

import pytest

from conftest import OK
from openpretrain.posttrain.client import ChatClient, ChatError, MalformedAnswer, logprob_entry, read_json

HELLO = [{"role": "user", "content": "Hallo"}]


def with_logprobs(content) -> dict:
    "OK with `content` as choices[0].logprobs.content."
    return {"choices": [{**OK["choices"][0], "logprobs": {"content": content}}]}


GOOD_ENTRY = {"token": "7", "logprob": -0.1, "top_logprobs": [{"token": "7", "logprob": -0.1}, {"token": "8", "logprob": -2.5}]}
MALFORMED = [  # (a 200's body, what the error must say)
    (with_logprobs("7"), "logprobs.content is not a list"),
    ({"choices": [{**OK["choices"][0], "logprobs": "7"}]}, "logprobs is not an object"),
    (b'{"choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested deeper than 64"),
    (json.dumps(OK).encode().replace(b"Allegra", b"Allegra \xff\xfe"), "non-UTF-8"),
    (b'{"choices": [], "usage": ' + b"7" * 5000 + b"}", "non-JSON"),
    (with_logprobs([{**GOOD_ENTRY, "logprob": 1000.0}]), "logprobs.content[0]: log-prob 1000.0"),
    (json.dumps(with_logprobs([{**GOOD_ENTRY, "logprob": math.nan}])).encode(), "log-prob nan"),
    (with_logprobs([GOOD_ENTRY, {**GOOD_ENTRY, "token": 7}]), "logprobs.content[1]: an entry without a string token"),
    (with_logprobs([{**GOOD_ENTRY, "top_logprobs": "7"}]), "logprobs.content[0]: top_logprobs is not a list"),
    (with_logprobs([{"token": "7", "logprob": -0.1}]), "logprobs.content[0]: top_logprobs is not a list"),
    (with_logprobs([{**GOOD_ENTRY, "top_logprobs": [{"token": "7", "logprob": "-0.1"}]}]),
     "logprobs.content[0].top_logprobs[0]: log-prob '-0.1'"),
    ({"choices": [{**OK["choices"][0], "finish_reason": 7}]}, "finish_reason is not a string"),
    ([OK], r"no choices[0].message.content"),
]


@pytest.mark.parametrize("body,message", MALFORMED, ids=[m for _, m in MALFORMED])
def test_a_malformed_200_is_a_one_line_chat_error_naming_the_server_and_never_cached(fake, tmp_path, body, message):
    base, state = fake
    state["script"] = [(200, body, 0.0)]
    with pytest.raises(ChatError) as e:
        ChatClient(base, retries=2, backoff=0.0, cache_dir=tmp_path).chat(HELLO, logprobs=True, top_logprobs=2)
    assert message in str(e.value) and base in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 400
    assert isinstance(e.value, MalformedAnswer) != message.startswith(("nested", "non-"))   # its fields, not its JSON
    assert state["hits"] == 1 and not list(tmp_path.rglob("*.json"))          # an answer that came is not asked again


def test_well_formed_log_probs_pass_unchanged(fake):
    base, state = fake
    state["script"] = [(200, with_logprobs([GOOD_ENTRY, {**GOOD_ENTRY, "logprob": 0, "top_logprobs": []}]), 0.0)]
    reply = ChatClient(base).chat(HELLO, logprobs=True, top_logprobs=2)
    assert reply.logprobs == [GOOD_ENTRY, {**GOOD_ENTRY, "logprob": 0, "top_logprobs": []}] and reply.text == "Allegra"
    assert logprob_entry({"token": " 9", "logprob": -1}) == (" 9", -1.0)
    for bad in ({"token": "9", "logprob": True}, {"token": "9", "logprob": -(10 ** 400)}, {"token": "9", "logprob": -math.inf},
                {"token": "9", "logprob": 1e-9}, ["9", -1.0], {"token": None, "logprob": -1.0}):
        with pytest.raises(ValueError):
            logprob_entry(bad)


@pytest.mark.parametrize("status,body,message", [
    (500, b'{"error": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "HTTP 500: '{\"error\": [[["),
    (400, {"error": {"message": "line one\nline two"}}, "HTTP 400: line one line two"),
    (503, b"\xff\xfe busy", "HTTP 503: '\ufffd\ufffd busy'"),
])
def test_an_error_answer_is_one_line_whatever_its_body(fake, status, body, message):
    base, state = fake
    state["script"] = [(status, body, 0.0)]
    with pytest.raises(ChatError) as e:
        ChatClient(base, retries=0).chat(HELLO)
    assert message in str(e.value) and "\n" not in str(e.value)


def trickle(handler, state):
    "Headers at once, then a byte every 0.2 s, for at most 30 s (until the client hangs up)."
    raw = json.dumps(OK).encode()
    handler.send_response(200)
    handler.send_header("content-length", str(len(raw)))
    handler.end_headers()
    for i in range(len(raw)):
        handler.wfile.write(raw[i:i + 1])
        handler.wfile.flush()
        time.sleep(0.2)


def test_a_trickled_reply_is_cut_off_at_the_deadline_and_not_sent_again(fake):
    base, state = fake
    state["script"] = [trickle]
    assert ChatClient(base, timeout=1).deadline == 3.0                      # a few times the timeout by default
    t0 = time.perf_counter()
    with pytest.raises(ChatError, match=r"no complete answer within the deadline of 1.5 s \(after 1 attempts\)"):
        ChatClient(base, timeout=1, deadline=1.5, retries=2).chat(HELLO)
    assert 1.5 <= time.perf_counter() - t0 < 3 and state["hits"] == 1       # each byte within the timeout: only the deadline stops it


def flood(handler, state):
    "A chunked 256 MiB answer (no content-length), 64 KiB a write, stopped when the client hangs up."
    handler.send_response(200)
    handler.send_header("transfer-encoding", "chunked")
    handler.end_headers()
    chunk = b"[" * 65536
    for _ in range(4096):
        handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        state["sent"] += len(chunk)


def announce(handler, state):
    "An answer that announces 256 MiB and sends 64 KiB."
    handler.send_response(200)
    handler.send_header("content-length", str(256 * 2 ** 20))
    handler.end_headers()
    handler.wfile.write(b"[" * 65536)


def test_a_reply_past_max_reply_bytes_is_refused_without_reading_it_whole(fake):
    base, state = fake
    assert ChatClient(base).max_reply_bytes == 16 * 2 ** 20
    state["script"] = [flood]
    with pytest.raises(ChatError, match=r"answered more than max_reply_bytes = 1,048,576 bytes \(after 1 attempts\)"):
        ChatClient(base, max_reply_bytes=2 ** 20, retries=2).chat(HELLO)
    time.sleep(0.2)
    assert state["hits"] == 1 and state["sent"] < 64 * 2 ** 20              # it stopped reading: the server could not go on
    state["script"], t0 = [announce], time.perf_counter()
    with pytest.raises(ChatError, match=r"announced 268,435,456 bytes, more than max_reply_bytes = 1,048,576"):
        ChatClient(base, max_reply_bytes=2 ** 20, timeout=5).chat(HELLO)
    assert time.perf_counter() - t0 < 2                                      # refused at the headers, not after waiting


@pytest.mark.parametrize("setting,value", [("max_concurrency", 0), ("retries", -1), ("timeout", 0), ("timeout", math.nan),
                                           ("deadline", 0), ("max_reply_bytes", 0), ("backoff", -1.0), ("retries", 1.5)])
def test_bad_settings_are_refused_when_the_client_is_made(setting, value):
    with pytest.raises(ValueError, match=f"ChatClient: {setting} must be"):
        ChatClient("http://127.0.0.1:9/v1", **{setting: value})


def test_only_requests_the_server_did_not_take_are_sent_again(fake):
    base, state = fake
    state["script"] = [(200, OK, 1.0)]                        # a long request: the server took it and is working on it
    with pytest.raises(ChatError, match=r"no answer within 0.2 s \(after 1 attempts\)"):
        ChatClient(base, timeout=0.2, retries=3, backoff=0.0).chat(HELLO)
    assert state["hits"] == 1
    state["script"], state["hits"] = [(500, {"error": {"message": "oops"}}, 0.0), (503, b"", 0.0), (200, OK, 0.0)], 0
    assert ChatClient(base, retries=3, backoff=0.0).chat(HELLO).text == "Allegra" and state["hits"] == 3


def corrupt(path, how: str) -> None:
    "Break the cache entry at `path`: truncated, empty, non-UTF-8, list-shaped, malformed or a directory."
    text = path.read_bytes()
    if how == "directory":
        path.unlink()
        path.mkdir()
        return
    path.write_bytes({"truncated": text[:len(text) // 2], "empty": b"", "non-UTF-8": b"\xff" + text,
                      "list-shaped": json.dumps([json.loads(text)]).encode(),
                      "malformed": json.dumps(with_logprobs([{**GOOD_ENTRY, "logprob": 3.0}])).encode()}[how])


@pytest.mark.parametrize("how", ["truncated", "empty", "non-UTF-8", "list-shaped", "malformed", "directory"])
def test_a_bad_cache_entry_is_a_miss_that_is_fetched_again_and_overwritten(fake, tmp_path, how):
    base, state = fake
    client = ChatClient(base, cache_dir=tmp_path)
    assert client.chat(HELLO).text == "Allegra" and state["hits"] == 1
    [entry] = tmp_path.rglob("*.json")
    corrupt(entry, how)
    assert client.chat(HELLO).text == "Allegra" and state["hits"] == 2      # a miss, not a ChatError blamed on the server
    if how != "directory":
        assert json.loads(entry.read_text()) == OK and client.chat(HELLO).text == "Allegra" and state["hits"] == 2
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_failed_cache_write_keeps_the_reply(fake, tmp_path, monkeypatch):
    base, state = fake
    (tmp_path / "file").write_text("not a folder")                 # a cache that cannot be written (root ignores chmod)
    client = ChatClient(base, cache_dir=tmp_path / "file" / "cache")
    assert client.chat(HELLO).text == "Allegra" and client.unsaved == 1
    full = ChatClient(base, cache_dir=tmp_path / "full")

    def no_space(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "replace", no_space)                   # the disk fills while the answer is written
    assert full.chat(HELLO).text == "Allegra" and full.unsaved == 1
    assert not list((tmp_path / "full").rglob("*.json")) and not list((tmp_path / "full").rglob("*.tmp"))
    assert state["hits"] == 2


def test_read_json_bounds_depth_and_refuses_what_is_not_utf8_json():
    assert read_json(b'{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]} and read_json("[[1]]", max_depth=2) == [[1]]
    for bad, why in ((b"[[[1]]]", "nested deeper than 2"), (b"\xff", "non-UTF-8"), ("[1", "non-JSON"),
                     ("[" * 100_000, "nested deeper than 2"), ("1" * 5000, "non-JSON")):
        with pytest.raises(ValueError, match=why):
            read_json(bad, max_depth=2)
