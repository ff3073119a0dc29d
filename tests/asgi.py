"""One HTTP request to an ASGI app in this process, no server: its status and body.

For the HTTP API's tests that need the real app (middleware, routes, error mapping) but neither a
socket nor uvicorn. The body is sent as raw bytes, so a test can send JSON that ``json.dumps``
writes (escapes such as ``"\\ud800"`` included) or bytes of its own.
"""

from __future__ import annotations

import asyncio
import json


def asgi_call(
    app,
    method: str,
    path: str,
    body: dict | bytes | None = None,
    headers: list[tuple[bytes, bytes]] = (),
) -> tuple[int, bytes]:
    """(status, body) of ``method path`` with ``body`` (a dict is sent as JSON)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body or b""

    async def run() -> tuple[int, bytes]:
        messages = [{"type": "http.request", "body": data, "more_body": False}]
        done = asyncio.Event()
        out = {"status": 0, "body": b""}

        async def receive():
            if messages:
                return messages.pop(0)
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                out["status"] = message["status"]
            elif message["type"] == "http.response.body":
                out["body"] += message.get("body", b"")
                if not message.get("more_body"):
                    done.set()

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *headers,
            ],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 8080),
        }
        await app(scope, receive, send)
        return out["status"], out["body"]

    return asyncio.run(run())


def asgi_json(app, method: str, path: str, body: dict | bytes | None = None) -> tuple[int, dict]:
    """(status, parsed JSON answer) of ``asgi_call``."""
    status, answer = asgi_call(app, method, path, body)
    return status, json.loads(answer)
