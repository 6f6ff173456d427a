"""The endpoint: a small HTTP server in the trainer's process, on 127.0.0.1, one per run.

    POST /v1/chat/completions          OpenAI's chat completions (no streaming); the session id
                                       in the X-Session-Id header, extra_body's session_id, or
                                       the user field
    POST /v1/episodes/{session}/reward {"reward": 1.0, "group": optional}: the episode is over
    GET  /v1/models                    the run's one model

Every request carries `Authorization: Bearer TOKEN`, the run's token; any other is answered 401.
Errors are OpenAI's shape ({"error": {"message", "type", "code"}}), so the `openai` client raises
its own exceptions (BadRequestError, AuthenticationError, ...) with the message. A chat call's
thread waits while the driver (trainer/agents/driver.py) generates: during a training step the
engine is the trainer's, and calls wait for the next step's generation.
"""
from __future__ import annotations

import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

from trainer.agents.chat import AgentError
from trainer.agents.sessions import Sessions, session_id

MAX_BODY = 8 << 20
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 410: "gone",
          409: "conflict_error", 503: "service_unavailable"}


class AgentServer:
    """Serves `sessions` on 127.0.0.1:`port` (0: a free one) to holders of `token`."""

    def __init__(self, sessions: Sessions, token: str, port: int = 0, model: str = "rlpilot"):
        if not token:
            raise ValueError("the agents' endpoint needs a token")
        self.sessions, self.token, self.model = sessions, token, model
        handler = type("Handler", (_Handler,), {"app": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", int(port)), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="rlpilot-agents",
                                       daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> "AgentServer":
        self.thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def authorised(self, header: str | None) -> bool:
        scheme, _, given = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                                  self.token.encode())


class _Handler(BaseHTTPRequestHandler):
    app: AgentServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:   # the run's log is its events, not stderr lines
        pass

    def do_GET(self) -> None:
        if not self._auth():
            return
        if self.path.rstrip("/") == "/v1/models":
            self._send(200, {"object": "list", "data": [
                {"id": self.app.model, "object": "model", "owned_by": "rlpilot"}]})
        else:
            self._error(AgentError(404, f"no such path {self.path!r}"))

    def do_POST(self) -> None:
        try:
            body = self._body()   # read first: a connection kept alive must not hold it
        except AgentError as e:
            self.close_connection = True
            self._error(e)
            return
        if not self._auth():
            return
        try:
            path = self.path.split("?", 1)[0].rstrip("/")
            if path == "/v1/chat/completions":
                self._send(200, self._chat(body))
            elif path.startswith("/v1/episodes/") and path.endswith("/reward"):
                sid = unquote(path[len("/v1/episodes/"):-len("/reward")])
                self._send(200, self.app.sessions.reward(sid, body))
            else:
                raise AgentError(404, f"no such path {self.path!r}")
        except AgentError as e:
            self._error(e)

    def _chat(self, body: dict) -> dict:
        call = self.app.sessions.call(session_id(body, self.headers.get("X-Session-Id")), body)
        while not call.done.wait(1.0):
            if self.app.sessions.closed:
                raise AgentError(503, "the run is over")
        if call.error is not None:
            raise call.error
        return {**call.response, "model": body.get("model") or self.app.model}

    def _auth(self) -> bool:
        if self.app.authorised(self.headers.get("Authorization")):
            return True
        self._error(AgentError(401, "this run's endpoint takes its own token only "
                                    "(Authorization: Bearer TOKEN)"))
        return False

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise AgentError(400, f"the request is over {MAX_BODY} bytes")
        try:
            body = json.loads(self.rfile.read(n) or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise AgentError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise AgentError(400, "the body must be a JSON object")
        return body

    def _error(self, e: AgentError) -> None:
        self._send(e.status, {"error": {"message": e.message, "type": _TYPES.get(e.status, "error"),
                                        "code": e.status}})

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
