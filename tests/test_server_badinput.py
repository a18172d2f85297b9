"""Bad input never breaks the server: each case gets the OpenAI error JSON with the right 4xx
status (never a 500), and the server keeps serving good requests afterwards."""

from __future__ import annotations

import asyncio
import gzip
import json

import aiohttp
import pytest
import pytest_asyncio

from .server_helpers import MODEL_NAME, live_server, open_engine, wait_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")
CTX = 256
MAX_BODY = 64 * 1024
MSGS = [{"role": "user", "content": "hi"}]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tmp_path_factory):
    async with open_engine(tmp_path_factory.mktemp("tiny_bad"), parallel=2, ctx=CTX) as eng:
        yield eng


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def base_url(engine):
    async with live_server(engine, max_body_bytes=MAX_BODY) as url:
        yield url


def TOOL(name, parameters=None):  # noqa: N802 - reads like a constructor in the table
    return {"type": "function", "function": {"name": name, "parameters": parameters or {
        "type": "object", "properties": {}}}}


def chat(**fields):
    return {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 4, **fields}


def comp(**fields):
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, **fields}


# (route, JSON body, expected status, expected `param` or None)
JSON_CASES = {
    "json array body": ("/v1/chat/completions", [1, 2], 400, None),
    "messages missing": ("/v1/chat/completions", {"model": MODEL_NAME}, 400, "messages"),
    "messages empty": ("/v1/chat/completions", chat(messages=[]), 400, "messages"),
    "message not an object": ("/v1/chat/completions", chat(messages=["hi"]), 400, "messages[0]"),
    "message bad role": ("/v1/chat/completions",
                         chat(messages=[{"role": "wizard", "content": "x"}]), 400,
                         "messages[0].role"),
    "message content wrong type": ("/v1/chat/completions",
                                   chat(messages=[{"role": "user", "content": 5}]), 400,
                                   "messages[0].content"),
    "message unknown field": ("/v1/chat/completions",
                              chat(messages=[{"role": "user", "content": "x", "mood": 1}]), 400,
                              "messages[0].mood"),
    "image part": ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages[0].content[0].type"),
    "unknown top-level field": ("/v1/chat/completions", chat(frobnicate=True), 400, "frobnicate"),
    "temperature wrong type": ("/v1/chat/completions", chat(temperature="hot"), 400,
                               "temperature"),
    "temperature too high": ("/v1/chat/completions", chat(temperature=7), 400, "temperature"),
    "temperature negative": ("/v1/completions", comp(temperature=-0.5), 400, "temperature"),
    "top_p zero": ("/v1/completions", comp(top_p=0), 400, "top_p"),
    "min_p above one": ("/v1/completions", comp(min_p=1.5), 400, "min_p"),
    "penalty out of range": ("/v1/completions", comp(presence_penalty=3), 400,
                             "presence_penalty"),
    "max_tokens negative": ("/v1/completions", comp(max_tokens=-3), 400, "max_tokens"),
    "max_tokens zero": ("/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens"),
    "max_tokens huge": ("/v1/completions", comp(max_tokens=10**12), 400, "max_tokens"),
    "max_tokens over context": ("/v1/completions", comp(max_tokens=CTX + 1), 400, "max_tokens"),
    "prompt + max_tokens over context": ("/v1/completions", comp(max_tokens=CTX - 1), 400,
                                         "max_tokens"),
    "prompt longer than context": ("/v1/completions", comp(prompt="word " * (4 * CTX)), 400,
                                   None),
    "max_completion_tokens wrong type": ("/v1/chat/completions",
                                         chat(max_completion_tokens=1.5), 400,
                                         "max_completion_tokens"),
    "n above the limit": ("/v1/completions", comp(n=17), 400, "n"),
    "n zero": ("/v1/chat/completions", chat(n=0), 400, "n"),
    "best_of not n": ("/v1/completions", comp(n=2, best_of=3), 400, "best_of"),
    "too many prompts": ("/v1/completions", comp(prompt=["a"] * 33), 400, "prompt"),
    "logit_bias key not an id": ("/v1/chat/completions", chat(logit_bias={"x": 1}), 400,
                                 "logit_bias"),
    "logit_bias value out of range": ("/v1/completions", comp(logit_bias={"5": 101}), 400,
                                      "logit_bias"),
    "logit_bias id out of vocab": ("/v1/completions", comp(logit_bias={"99999": 1}), 400,
                                   "logit_bias"),
    "logit_bias id out of vocab, n=3": ("/v1/completions",
                                        comp(logit_bias={"99999": 1}, n=3), 400, "logit_bias"),
    "min_tokens over max_tokens": ("/v1/completions", comp(min_tokens=9), 400, "min_tokens"),
    "stream_options without stream": ("/v1/chat/completions",
                                      chat(stream=False, stream_options={"include_usage": True}),
                                      400, "stream_options"),
    "reasoning_effort unknown": ("/v1/chat/completions", chat(reasoning_effort="max"), 400,
                                 "reasoning_effort"),
    "seed not an int": ("/v1/completions", comp(seed="abc"), 400, "seed"),
    "seed too big": ("/v1/completions", comp(seed=2**70), 400, "seed"),
    "stop wrong type": ("/v1/completions", comp(stop=5), 400, "stop"),
    "stop empty string": ("/v1/completions", comp(stop=[""]), 400, "stop[0]"),
    "too many stops": ("/v1/completions", comp(stop=["a"] * 40), 400, "stop"),
    "prompt missing": ("/v1/completions", {"model": MODEL_NAME}, 400, "prompt"),
    "prompt empty": ("/v1/completions", comp(prompt=""), 400, "prompt"),
    "prompt ids out of vocab": ("/v1/completions", comp(prompt=[1, 99999]), 400, "prompt"),
    "prompt mixes ids and text": ("/v1/completions", comp(prompt=[1, "b"]), 400, "prompt"),
    "prompt batch with an empty one": ("/v1/completions", comp(prompt=["a", ""]), 400, "prompt"),
    "echo": ("/v1/completions", comp(echo=True), 400, "echo"),
    "logprobs too many": ("/v1/completions", comp(logprobs=50), 400, "logprobs"),
    "top_logprobs without logprobs": ("/v1/chat/completions", chat(top_logprobs=2), 400,
                                      "top_logprobs"),
    "tool without function": ("/v1/chat/completions", chat(tools=[{"type": "function"}]), 400,
                              "tools[0].function"),
    "tool name with spaces": ("/v1/chat/completions", chat(tools=[TOOL("get weather")]), 400,
                              "tools[0].function.name"),
    "tool names repeated": ("/v1/chat/completions", chat(tools=[TOOL("f"), TOOL("f")]), 400,
                            "tools"),
    "tool_choice names no tool": ("/v1/chat/completions", chat(tools=[TOOL("f")], tool_choice={
        "type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    "tool_choice required without tools": ("/v1/chat/completions",
                                           chat(tool_choice="required"), 400, "tool_choice"),
    "tool parameters not a schema": ("/v1/chat/completions", chat(
        tools=[TOOL("f", {"type": "objekt"})], tool_choice="required"), 400, "tools"),
    "user content null": ("/v1/chat/completions",
                          chat(messages=[{"role": "user", "content": None}]), 400,
                          "messages[0].content"),
    "response_format bad schema": ("/v1/chat/completions", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}), 400,
        "response_format.json_schema.schema"),
    "response_format without json_schema": ("/v1/chat/completions",
                                             chat(response_format={"type": "json_schema"}), 400,
                                             "response_format.json_schema"),
    "response_format unknown type": ("/v1/chat/completions",
                                     chat(response_format={"type": "yaml"}), 400,
                                     "response_format.type"),
    "stream not a bool": ("/v1/chat/completions", chat(stream="yes"), 400, "stream"),
    "unknown model": ("/v1/chat/completions", chat(model="gpt-4"), 404, "model"),
    "model is a path": ("/v1/completions", comp(model="/etc/passwd"), 404, "model"),
    "tokenize nothing": ("/tokenize", {}, 400, "prompt"),
    "detokenize negative id": ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
    "detokenize out of vocab": ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
}


async def _assert_error(resp: aiohttp.ClientResponse, status: int) -> dict:
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(JSON_CASES))
async def test_bad_json_request(base_url, case, stream):
    route, body, status, param = JSON_CASES[case]
    if stream and isinstance(body, dict) and "stream" not in body and route.startswith("/v1/"):
        body = {**body, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(base_url + route, json=body) as resp:
        error = await _assert_error(resp, status)
    if param is not None:
        assert error["param"] == param, error


RAW_CASES = {
    "malformed JSON": (b'{"model": "x", "messages": [', "application/json", 400),
    "not UTF-8": (b'{"prompt": "\xff\xfe"}', "application/json", 400),
    "empty body": (b"", "application/json", 400),
    "wrong content type": (json.dumps(comp()).encode(), "text/plain", 415),
    "form content type": (b"prompt=hi", "application/x-www-form-urlencoded", 415),
    "body over the limit": (b'{"prompt": "' + b"a" * (MAX_BODY + 10) + b'"}',
                            "application/json", 413),
}
ENCODED_CASES = {"unknown encoding": ("zstd-x", json.dumps(comp()).encode(), 415),
                 "two encodings": ("gzip, deflate", json.dumps(comp()).encode(), 415),
                 "gzip of a body over the limit": ("gzip", gzip.compress(b" " * (4 * MAX_BODY)),
                                                   413)}


@pytest.mark.parametrize("case", list(ENCODED_CASES))
async def test_bad_content_encoding(base_url, case):
    encoding, body, status = ENCODED_CASES[case]
    async with aiohttp.ClientSession() as http, http.post(
            base_url + "/v1/completions", data=body,
            headers={"Content-Type": "application/json", "Content-Encoding": encoding}) as resp:
        await _assert_error(resp, status)


@pytest.mark.parametrize("case", list(RAW_CASES))
async def test_bad_raw_body(base_url, case):
    body, content_type, status = RAW_CASES[case]
    async with aiohttp.ClientSession() as http, http.post(
            base_url + "/v1/completions", data=body,
            headers={"Content-Type": content_type}) as resp:
        await _assert_error(resp, status)


async def test_chunked_body_over_the_limit_is_413(base_url):
    async def chunks():
        yield b'{"prompt": "'
        for _ in range(4):
            yield b"a" * MAX_BODY
        yield b'"}'

    async with aiohttp.ClientSession() as http, http.post(
            base_url + "/v1/completions", data=chunks(),
            headers={"Content-Type": "application/json"}) as resp:
        await _assert_error(resp, 413)


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/nothing-here", 404), ("GET", "/v1/completions", 405),
    ("DELETE", "/v1/models", 405), ("GET", "/v1/models/other-model", 404)])
async def test_unknown_routes_and_methods(base_url, method, path, status):
    async with aiohttp.ClientSession() as http, http.request(method, base_url + path) as resp:
        await _assert_error(resp, status)


async def test_server_still_serves_after_all_bad_input(engine, base_url):
    async with aiohttp.ClientSession() as http, http.post(
            base_url + "/v1/chat/completions", json=chat(temperature=0)) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["finish_reason"] in ("stop", "length")
    await wait_idle(engine)
    async with aiohttp.ClientSession() as http, http.get(base_url + "/metrics") as resp:
        text = await resp.text()
    assert 'outcome="bad_input"' in text and 'outcome="error"' not in text


@pytest.mark.parametrize(("frame", "param"), [
    ("{not json", None), ('{"type": "dance", "id": 1}', "type"), ('{"type": "chat"}', "id"),
    ('{"type": "chat", "id": 1, "messages": []}', "messages"),
    ('{"type": "chat", "id": 1, "messages": [{"role": "user", "content": "x"}], '
     '"temperature": -1}', "temperature"),
    ('{"type": "chat", "id": 1, "messages": [{"role": "user", "content": "x"}], '
     '"model": "other"}', "model"),
    ('{"type": "chat", "id": 1, "messages": [{"role": "user", "content": "x"}], '
     f'"max_tokens": {CTX}}}', "max_tokens"),
])
async def test_bad_websocket_messages_keep_the_socket_open(base_url, frame, param):
    async with aiohttp.ClientSession() as http, http.ws_connect(base_url + "/v1/chat/ws") as ws:
        await ws.send_str(frame)
        msg = await ws.receive_json()
        assert msg["type"] == "error" and msg["error"]["param"] == param, msg
        await ws.send_bytes(b"\x00\x01")
        assert (await ws.receive_json())["type"] == "error"
        await ws.send_json({"type": "chat", "id": "ok", "messages": MSGS, "max_tokens": 3,
                            "temperature": 0})
        while (msg := await ws.receive_json())["type"] == "delta":
            pass
        assert msg["type"] == "done" and msg["id"] == "ok"


async def _raw_exchange(base_url: str, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes on a fresh connection; parse the one HTTP response that comes back."""
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 60)
    finally:
        writer.close()
    return int(lines[0].split()[1]), headers, body


BODY = json.dumps(comp()).encode()
POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
PARSER_CASES = {
    "gzip body that is not gzip": POST + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
                                  % len(BODY) + BODY,
    "deflate body that is not deflate": POST + b"Content-Encoding: deflate\r\n"
                                        b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY,
    "br encoding": POST + b"Content-Encoding: br\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY,
    "bad Content-Length": POST + b"Content-Length: abc\r\n\r\n" + BODY,
    "bad chunk size": POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
    "over-long URL": b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "over-long header": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000
                        + b"\r\n\r\n",
    "bad method": b"G(T /health HTTP/1.1\r\nHost: x\r\n\r\n",
}


@pytest.mark.parametrize("case", list(PARSER_CASES))
async def test_malformed_http_is_a_400_json_without_a_logged_traceback(base_url, case, caplog):
    status, headers, body = await _raw_exchange(base_url, PARSER_CASES[case])
    assert status == 400, body
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    async with aiohttp.ClientSession() as http, http.get(base_url + "/health") as resp:
        assert resp.status == 200


async def test_body_cut_off_by_a_client_that_left_counts_as_a_disconnect(engine):
    from aiohttp.test_utils import make_mocked_request

    from tf_async.server.app import Server

    server = Server(engine, api_key=None, cors_origin=None, model_name=None,
                    max_body_bytes=MAX_BODY)
    request = make_mocked_request("POST", "/v1/chat/completions",
                                  headers={"Content-Type": "application/json"})
    request.transport.is_closing.return_value = True  # the client has gone

    async def cut_body() -> bytes:
        return b'{"messages": [{"role": "us'

    request.read = cut_body  # type: ignore[method-assign]
    tracker = server.metrics.tracker("chat")
    with pytest.raises(ConnectionResetError), tracker.guard():
        await server.read_json(request, dict)
    text = server.metrics.render().decode()
    assert 'outcome="cancelled"' in text and 'outcome="bad_input"' not in text
