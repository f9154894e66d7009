"""What the client tests share: `fake`, a scripted HTTP server on 127.0.0.1 that each test starts and stops, and `OK`,
the chat answer it gives unless told otherwise."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

OK = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Allegra"}, "finish_reason": "stop"}]}


@pytest.fixture
def fake():
    "A server answering its `script` in turn (the last entry forever): (status, body, delay) or a function that writes the response."
    state = {"script": [(200, OK, 0.0)], "hits": 0, "sent": 0}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            entry = state["script"][min(state["hits"], len(state["script"]) - 1)]
            state["hits"] += 1
            if callable(entry):
                return entry(self, state)
            status, body, delay = entry
            time.sleep(delay)
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.handle_error = lambda request, address: None           # a client that hung up: what these tests do
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", state
    server.shutdown()
    server.server_close()
    thread.join(5)
