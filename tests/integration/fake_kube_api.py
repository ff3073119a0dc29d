"""A small Kubernetes API server for tests: ConfigMaps (list, watch) and Events (create) in the
JSON the real API server speaks, on a real socket, so that the real ``kubernetes`` client talks
to it through a kubeconfig. No cluster can run here.

Only what the services use is served: ``GET /api/v1/namespaces/{ns}/configmaps`` with a
``metadata.name=`` field selector (a list, or with ``watch=true`` a stream of newline-separated
watch events that stays open until ``timeoutSeconds`` or the server stops) and
``POST /api/v1/namespaces/{ns}/events``. Every request must carry the bearer token; ``forbid``
answers 403 the way RBAC does.
"""

from __future__ import annotations

import json
import queue
import threading
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TOKEN = "test-token"


class FakeKubeApi:
    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.configmaps: dict[str, dict] = {}
        self.events: list[dict] = []
        self.requests: list[str] = []
        self.forbid = False
        self._version = 100
        self._lock = threading.Lock()
        self._watchers: list[tuple[str, queue.Queue]] = []
        self._stopped = threading.Event()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # a watch streams its events as chunks, as the API server does

            def log_message(self, *_args) -> None:
                pass

            def do_GET(self) -> None:
                api._get(self)

            def do_POST(self) -> None:
                api._post(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "sa", "user": {"token": TOKEN}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "sa"}}],
                    "current-context": "fake",
                }
            )
        )
        return path

    # -- state -----------------------------------------------------------------------------
    def set_configmap(self, name: str, data: dict[str, str]) -> None:
        """Create or replace ConfigMap ``name``; open watches get ADDED or MODIFIED."""
        with self._lock:
            self._version += 1
            existing = self.configmaps.get(name)
            uid = existing["metadata"]["uid"] if existing else str(uuid.uuid4())
            obj = {
                "kind": "ConfigMap",
                "apiVersion": "v1",
                "metadata": {
                    "name": name,
                    "namespace": self.namespace,
                    "uid": uid,
                    "resourceVersion": str(self._version),
                },
                "data": dict(data),
            }
            self.configmaps[name] = obj
            event = {"type": "MODIFIED" if existing else "ADDED", "object": obj}
            for watched, q in self._watchers:
                if watched == name:
                    q.put(event)

    def watchers(self, name: str) -> int:
        with self._lock:
            return sum(1 for watched, _q in self._watchers if watched == name)

    def close(self) -> None:
        self._stopped.set()
        with self._lock:
            for _name, q in self._watchers:
                q.put(None)
        self.server.shutdown()
        self.server.server_close()

    # -- HTTP --------------------------------------------------------------------------------
    def _authorized(self, h: BaseHTTPRequestHandler) -> bool:
        if h.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._status(h, 401, "Unauthorized", "no or wrong bearer token")
            return False
        if self.forbid:
            self._status(h, 403, "Forbidden", 'configmaps is forbidden: cannot list resource "configmaps"')
            return False
        return True

    def _status(self, h: BaseHTTPRequestHandler, code: int, reason: str, message: str) -> None:
        self._json(
            h,
            code,
            {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "message": message,
                "reason": reason,
                "code": code,
            },
        )

    def _json(self, h: BaseHTTPRequestHandler, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _get(self, h: BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(h.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        self.requests.append(f"GET {h.path}")
        if not self._authorized(h):
            return
        prefix = f"/api/v1/namespaces/{self.namespace}/configmaps"
        if url.path != prefix:
            self._status(h, 404, "NotFound", f"no route {url.path}")
            return
        selector = query.get("fieldSelector", "")
        if not selector.startswith("metadata.name="):
            self._status(h, 400, "BadRequest", "the fake serves only metadata.name= selectors")
            return
        name = selector.split("=", 1)[1]
        if query.get("watch") in ("true", "1", "True"):
            self._watch(h, name, float(query.get("timeoutSeconds", "30")))
            return
        with self._lock:
            items = [self.configmaps[name]] if name in self.configmaps else []
            version = str(self._version)
        self._json(
            h,
            200,
            {
                "kind": "ConfigMapList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": version},
                "items": items,
            },
        )

    def _watch(self, h: BaseHTTPRequestHandler, name: str, timeout_s: float) -> None:
        q: queue.Queue = queue.Queue()
        entry = (name, q)
        with self._lock:
            self._watchers.append(entry)
        try:
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            h.wfile.flush()
            h.close_connection = True
            try:
                while not self._stopped.is_set():
                    try:
                        event = q.get(timeout=timeout_s)
                    except queue.Empty:
                        break  # timeoutSeconds: the server ends the watch, the client watches again
                    if event is None:
                        break
                    line = json.dumps(event).encode() + b"\n"
                    h.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))  # one chunk per event
                    h.wfile.flush()
                h.wfile.write(b"0\r\n\r\n")
                h.wfile.flush()
            except OSError:
                return  # the client went away
        finally:
            with self._lock:
                self._watchers.remove(entry)

    def _post(self, h: BaseHTTPRequestHandler) -> None:
        self.requests.append(f"POST {h.path}")
        length = int(h.headers.get("Content-Length", "0"))
        body = json.loads(h.rfile.read(length) or b"{}")
        if not self._authorized(h):
            return
        if h.path != f"/api/v1/namespaces/{self.namespace}/events":
            self._status(h, 404, "NotFound", f"no route {h.path}")
            return
        metadata = body.setdefault("metadata", {})
        metadata["name"] = metadata.get("generateName", "event.") + uuid.uuid4().hex[:8]
        metadata["namespace"] = self.namespace
        with self._lock:
            self.events.append(body)
        self._json(h, 201, body)
