"""A STAND-IN for an SGLang server, for tests and demos. It is not SGLang, and it is not part of
the product: it lives with the tests (`tests/fakes/`). From the repository root:

    python tests/fakes/sglang_standin.py --model builtin --port 30000

(`trainer` must be importable, as it is after `make`'s editable install; in tests:
`from fakes.sglang_standin import StandinServer`).

rlpilot's SGLang client (`trainer/engine/sglang/`) is tested against a real SGLang server
(`tests/test_sglang_real.py`, after `make sglang`). This small HTTP server stays for what a real
server cannot be made to do on demand (HTTP 500s, slow or dying servers) and for quick runs
without `.venv-sglang`. It follows the request and response shapes SGLang 0.5.23 answered with,
for exactly the endpoints the client uses, and generates with rlpilot's embedded engine (so
log-probabilities are real):

  POST /generate                  {input_ids, sampling_params{temperature, top_p,
                                   max_new_tokens, stop_token_ids}, return_logprob, rid}
                                  -> {text, output_ids, meta_info{id, finish_reason{type: stop |
                                   length | abort, ...}, prompt_tokens, completion_tokens,
                                   cached_tokens, weight_version, weight_versions [{version,
                                   start, end}], output_token_logprobs
                                   [[logprob, token_id, null], ...]}}
  POST /abort_request             {rid} (every request whose rid starts with it, as SGLang does)
                                  or {abort_all: true}; the aborted /generate calls return what
                                  they generated so far with finish_reason abort
  POST /pause_generation          {mode: abort (default) | in_place | retract}; while paused, new
                                  /generate calls wait; "retract" is treated as "in_place"
  POST /continue_generation
  POST /update_weights_from_disk  {model_path, weight_version, abort_all_requests}: loads the
                                  *.safetensors files of model_path -> {success, message}
  GET|POST /flush_cache, GET /health, GET /get_model_info
  GET /server_info                {dtype, tp_size, model_path, version}: a few of the server
                                  arguments SGLang 0.5.23 answers with (at the top level, as it
                                  does); dtype is the stand-in's engine's (`dtype=`)

Differences from SGLang worth knowing: one model on CPU (or whatever device you give it), no
radix/prefix cache, `stop_token_ids` beyond the model's eos are ignored; an in_place pause does
not refuse /flush_cache and a weight update re-prefills the paused requests (SGLang keeps their
old KV cache and splits `weight_versions`). Log-probabilities are those of the temperature-scaled
distribution, as SGLang's are. It listens on
127.0.0.1 only. Test hooks: `fail_next(n, status)` makes the next n /generate calls fail with
that HTTP status; `step_delay_s` slows decoding down.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from trainer.engine.base import STOP, Sample, SamplingParams
from trainer.engine.embedded import EmbeddedEngine

HOST = "127.0.0.1"


class _Request:
    def __init__(self, rid: str, sample: Sample):
        self.rid, self.sample = rid, sample
        self.done = threading.Event()
        self.aborted = False
        self.weight_version = "default"
        self.started = time.monotonic()


class StandinServer:
    """The stand-in's state: an embedded engine, a generation thread and an HTTP server."""

    def __init__(self, model, tokenizer=None, *, eos_token_ids, port: int = 0, max_slots: int = 16,
                 max_seq_len: int = 1024, seed: int = 0, step_delay_s: float = 0.0,
                 model_path: str = "", dtype: torch.dtype | None = None):
        self.engine = EmbeddedEngine(model, eos_token_ids=eos_token_ids, max_slots=max_slots,
                                     max_seq_len=max_seq_len, seed=seed, dtype=dtype)
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.weight_version = "default"
        self.step_delay_s = step_delay_s
        self.paused = False
        self.cv = threading.Condition()
        self.requests: dict[str, _Request] = {}    # rid -> request not yet answered
        self.by_sample: dict[int, _Request] = {}   # sample.request_id -> request
        self.held: list[_Request] = []             # arrived while paused
        self.generate_calls = 0
        self._fail = (0, 500)
        self._stop = False
        self.httpd = _QuietHTTPServer((HOST, port), _make_handler(self))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://{HOST}:{self.port}"
        self._threads = [threading.Thread(target=self.httpd.serve_forever, name="standin-http",
                                          daemon=True),
                         threading.Thread(target=self._loop, name="standin-gen", daemon=True)]

    def start(self) -> "StandinServer":
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        with self.cv:
            self._stop = True
            for r in list(self.requests.values()):
                self._finish(r, aborted=True)
            self.cv.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()
        for t in self._threads:
            t.join(timeout=5)

    def fail_next(self, n: int, status: int = 500) -> None:
        """Test hook: the next n /generate calls answer `status` without generating."""
        with self.cv:
            self._fail = (n, status)

    # --- generation loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self._stop and (self.paused or not self.engine.num_pending):
                    self.cv.wait(0.1)
                if self._stop:
                    return
                for s in self.engine.step():
                    r = self.by_sample.get(s.request_id)
                    if r is not None:
                        self._finish(r, aborted=False)
            if self.step_delay_s:
                time.sleep(self.step_delay_s)

    def _finish(self, r: _Request, aborted: bool) -> None:
        """Under self.cv: answer request r."""
        r.aborted = r.aborted or aborted
        r.weight_version = self.weight_version
        self.requests.pop(r.rid, None)
        self.by_sample.pop(r.sample.request_id, None)
        r.done.set()

    def _abort(self, rid: str | None) -> int:
        """Under self.cv: abort every request whose rid starts with `rid` (all when None)."""
        targets = [r for r in self.requests.values()
                   if rid is None or (rid and r.rid.startswith(rid))]
        if not targets:
            return 0
        held = {id(r) for r in self.held}
        self.held = [r for r in self.held if r not in targets]
        self.engine.abort([r.sample.request_id for r in targets if id(r) not in held])
        for r in targets:
            self._finish(r, aborted=True)
        return len(targets)

    # --- endpoints ------------------------------------------------------------------------------
    def generate(self, body: dict) -> tuple[int, dict]:
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            return 400, {"error": {"message": "input_ids must be a non-empty list of token ids "
                                              "(this stand-in does not take text)"}}
        sp = body.get("sampling_params") or {}
        params = SamplingParams(temperature=float(sp.get("temperature", 1.0)),
                                top_p=float(sp.get("top_p", 1.0)),
                                max_new_tokens=int(sp.get("max_new_tokens", 128)))
        rid = str(body.get("rid") or uuid.uuid4().hex)
        with self.cv:
            self.generate_calls += 1
            n, status = self._fail
            if n > 0:
                self._fail = (n - 1, status)
                return status, {"error": {"message": f"stand-in: injected failure ({status})"}}
            if self._stop:
                return 503, {"error": {"message": "stand-in: shutting down"}}
            if rid in self.requests:
                return 400, {"error": {"message": f"duplicate rid {rid!r}"}}
            r = _Request(rid, Sample(list(ids), params))
            try:
                if self.paused:
                    self.held.append(r)
                else:
                    self.engine.submit([r.sample])
            except ValueError as e:  # too long for the context
                return 400, {"error": {"message": str(e)}}
            self.requests[rid] = r
            self.by_sample[r.sample.request_id] = r
            self.cv.notify_all()
        r.done.wait()
        s = r.sample
        out_ids = list(s.response_ids)
        if r.aborted:
            fr = {"type": "abort", "message": "Abort by request."}
        elif s.finish_reason == STOP:
            fr = {"type": "stop", "matched": out_ids[-1]}
        else:
            fr = {"type": "length", "length": len(out_ids)}
        meta = {"id": rid, "finish_reason": fr, "prompt_tokens": len(ids),
                "completion_tokens": len(out_ids), "cached_tokens": 0,
                "weight_version": r.weight_version,
                # one span: the stand-in answers with the version at reply time (SGLang splits
                # the spans where the weights changed under a running request)
                "weight_versions": [{"version": r.weight_version, "start": 0,
                                     "end": len(out_ids)}],
                "e2e_latency": time.monotonic() - r.started}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(s.logprobs, out_ids)]
            if body.get("logprob_start_len") == 0:   # the prompt's own, the first one null
                scored = self.engine.probe_logprobs(list(ids))["embedded"]
                meta["input_token_logprobs"] = ([[None, ids[0], None]]
                                                + [[lp, t, None] for lp, t in zip(scored, ids[1:])])
        text = self.tokenizer.decode(out_ids) if self.tokenizer is not None else ""
        return 200, {"text": text, "output_ids": out_ids, "meta_info": meta}

    def abort_request(self, body: dict) -> tuple[int, None]:
        with self.cv:
            if body.get("abort_all"):
                self._abort(None)
            elif body.get("rid"):
                self._abort(str(body["rid"]))
        return 200, None  # SGLang answers an empty 200

    def pause_generation(self, body: dict) -> tuple[int, dict]:
        mode = (body or {}).get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            return 400, {"error": {"message": f"unknown pause mode {mode!r}"}}
        with self.cv:
            self.paused = True
            if mode == "abort":
                self._abort(None)
        return 200, {"message": "Generation paused successfully."}

    def continue_generation(self, body: dict) -> tuple[int, dict]:
        with self.cv:
            self.paused = False
            held, self.held = self.held, []
            for r in held:
                self.engine.submit([r.sample])
            self.cv.notify_all()
        return 200, {"message": "Generation continued successfully."}

    def update_weights_from_disk(self, body: dict) -> tuple[int, dict]:
        from safetensors.torch import load_file

        path = Path(str(body.get("model_path", "")))
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            return 400, {"success": False, "message": f"no *.safetensors files in {path}"}
        tensors = {}
        for f in files:
            tensors.update(load_file(str(f)))
        known = set(self.engine.decoder.w)
        if not known & set(tensors):
            return 400, {"success": False, "message": f"{path} holds no weights of this model"}
        wv = body.get("weight_version")
        with self.cv:
            if body.get("abort_all_requests"):
                self._abort(None)
            try:
                digits = wv is not None and str(wv).isdigit()
                version = int(wv) if digits else self.engine.version + 1
                # in-flight sequences (pause mode in_place) are re-prefilled under the new weights
                self.engine.update_weights(tensors, version, recompute_kv=True)
            except RuntimeError as e:  # shape mismatch
                return 400, {"success": False, "message": f"failed to load {path}: {e}"}
            if wv is not None:
                self.weight_version = str(wv)
        return 200, {"success": True, "message": "Succeeded to update model weights.",
                     "num_paused_requests": 0}

    def server_info(self) -> dict:
        return {"dtype": str(self.engine.dtype).removeprefix("torch."), "tp_size": 1,
                "model_path": self.model_path, "version": "rlpilot stand-in, not SGLang"}

    def model_info(self) -> dict:
        return {"model_path": self.model_path, "weight_version": self.weight_version,
                "is_generation": True, "standin": "rlpilot stand-in, not SGLang"}


class _QuietHTTPServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        import sys

        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)  # a client hanging up is normal


def _make_handler(server: StandinServer):
    posts = {"/generate": server.generate, "/abort_request": server.abort_request,
             "/pause_generation": server.pause_generation,
             "/continue_generation": server.continue_generation,
             "/update_weights_from_disk": server.update_weights_from_disk}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "rlpilot-sglang-standin"

        def log_message(self, *args):  # quiet
            pass

        def _send(self, status: int, payload, content_type="application/json"):
            if payload is None:
                raw = b""
            elif isinstance(payload, str):
                raw, content_type = payload.encode(), "text/plain"
            else:
                raw = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _body(self):
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            return json.loads(raw) if raw.strip() else {}

        def _gone(self) -> bool:
            """After close(), a kept-alive connection is dropped unanswered, as a dead server's
            would be (a server restarted on the port answers the client's next connection)."""
            if server._stop and self.path.split("?")[0] != "/generate":
                self.close_connection = True
                return True
            return False

        def do_GET(self):
            path = self.path.split("?")[0]
            if self._gone():
                return
            if path == "/health":
                self._send(200, None)
            elif path == "/get_model_info":
                self._send(200, server.model_info())
            elif path == "/server_info":
                self._send(200, server.server_info())
            elif path == "/flush_cache":
                self._send(200, "Cache flushed.\n")
            else:
                self._send(404, {"error": {"message": f"not found: {path}"}})

        def do_POST(self):
            path = self.path.split("?")[0]
            if self._gone():
                return
            try:
                body = self._body()
            except ValueError:
                return self._send(400, {"error": {"message": "body is not JSON"}})
            if path == "/flush_cache":
                return self._send(200, "Cache flushed.\n")
            fn = posts.get(path)
            if fn is None:
                return self._send(404, {"error": {"message": f"not found: {path}"}})
            try:
                status, payload = fn(body)
            except Exception as e:  # noqa: BLE001 - a stand-in answers 500 like a real server
                status, payload = 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
            self._send(status, payload)

    return Handler


def main(argv=None) -> int:
    from trainer.models.loading import load_model, load_tokenizer

    p = argparse.ArgumentParser(prog="python tests/fakes/sglang_standin.py",
                                description="A stand-in for an SGLang server (NOT SGLang), "
                                "for testing rlpilot's SGLang client on CPU. Listens on 127.0.0.1.")
    p.add_argument("--model", default="builtin", help="'builtin' or a local HF model directory")
    p.add_argument("--port", type=int, default=30000, help="port on 127.0.0.1 (0 = any free)")
    p.add_argument("--max-slots", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    model = load_model(args.model, torch.device("cpu"), torch.float32).eval()
    srv = StandinServer(model, tok, eos_token_ids=[tok.eos_token_id], port=args.port,
                        max_slots=args.max_slots, max_seq_len=args.max_seq_len, seed=args.seed,
                        model_path=args.model).start()
    print(f"rlpilot SGLang stand-in (not SGLang) listening on {srv.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        srv.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
