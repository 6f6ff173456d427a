"""Fuzzing the JSON API: generated bodies and query strings for every endpoint (the
samples endpoints included), from a fixed seed, must never give a 500; every error is the JSON
error format, short. Bounded: a few hundred requests, ~10-20 s. (A WebSocket part lives with the consumer's tests.)

A failure names the case number: rerun with RLPILOT_FUZZ_CASE=<n> to send just that one."""
import json
import os
import random

import pytest

from trainer import config as config_mod
from webapp.dashboard.models import ApiToken, Run

pytestmark = pytest.mark.django_db

SEED = 20260512
CASES = 400

SURROGATES = ["\ud800", "\udfff", "a\udc80b", "\ud83d"]          # lone halves
ODD_TEXT = ["", " ", "\x00", "a\x00b", "\u202e", "\ufeff", "é", "😀", "\\", '"', "'", "<script>",
            "../../etc/passwd", "/etc/passwd", "http://169.254.169.254/", "${x}", "%s%n", "\n\r\t",
            "{prompt}", "builtin", "demo", "sglang", "true", "1e400", "NaN", "-0"]
HUGE_INTS = [10 ** 400, -(10 ** 400), 2 ** 63, 2 ** 64 + 1, -(2 ** 63) - 1, 10 ** 4000]
NUMBERS = [0, 1, -1, 0.5, 1e308, -1e308, 5e-324, -0.0, 3, 40, 1000, 10 ** 9]


def keys_of_schema():
    return [p.name for p in config_mod.schema()]


class Gen:
    def __init__(self, rng: random.Random):
        self.r = rng
        self.keys = keys_of_schema()

    def text(self) -> str:
        r = self.r
        kind = r.random()
        if kind < 0.25:
            return r.choice(ODD_TEXT)
        if kind < 0.4:
            return r.choice(ODD_TEXT) + r.choice(SURROGATES) + r.choice(ODD_TEXT)
        if kind < 0.5:
            return r.choice("ax\x00\ud800é") * r.choice([41, 201, 20_001, 100_001, 300_000])
        if kind < 0.6:
            return r.choice(self.keys)
        return "".join(chr(r.choice([r.randrange(32, 127), r.randrange(0, 0x110000)]))
                       for _ in range(r.randrange(0, 30)))

    def scalar(self):
        r = self.r
        kind = r.random()
        if kind < 0.3:
            return self.text()
        if kind < 0.45:
            return r.choice(HUGE_INTS)
        if kind < 0.7:
            return r.choice(NUMBERS)
        if kind < 0.85:
            return r.choice([True, False, None])
        return r.uniform(-1e6, 1e6)

    def value(self, depth: int = 0):
        r = self.r
        if depth > 3 or r.random() < 0.6:
            return self.scalar()
        if r.random() < 0.5:
            return [self.value(depth + 1) for _ in range(r.randrange(0, 4))]
        return {self.key(): self.value(depth + 1) for _ in range(r.randrange(0, 4))}

    def key(self) -> str:
        r = self.r
        return r.choice(self.keys) if r.random() < 0.5 else self.text()

    def overrides(self):
        r = self.r
        if r.random() < 0.2:
            return self.value()
        return {self.key(): self.value(2) for _ in range(r.randrange(0, 6))}

    def toml(self):
        r = self.r
        base = config_mod.to_toml(config_mod.load("demo"))
        kind = r.random()
        if kind < 0.3:
            lines = base.splitlines()
            i = r.randrange(len(lines))
            lines[i] = lines[i].split("=")[0] + "= " + r.choice(
                ['"' + self.text().replace('"', "") + '"', str(r.choice(HUGE_INTS)), "[[[[", "nan",
                 "inf", "{a = 1}", "1979-05-27"])
            return "\n".join(lines)
        if kind < 0.5:
            return "a = " + "[" * r.choice([100, 2000, 20_000]) + "]" * 3
        if kind < 0.6:
            return base + "\n[model]\npath = 'x'\n"
        return self.value()

    def launch_body(self, tiny):
        r = self.r
        if r.random() < 0.15:  # valid, with odd (storable) text: stored, then shown by the pages
            return {"name": r.choice(ODD_TEXT[1:]) + self.text()[:50], "preset": "demo",
                    "overrides": {**tiny, "data.prompt_template": "{prompt}" + r.choice(ODD_TEXT)}}
        if r.random() < 0.4:   # nearly valid: one fuzzed key or field on a launch that would work
            body = {"name": "fuzz", "preset": "demo", "overrides": dict(tiny)}
            if r.random() < 0.7:
                body["overrides"][self.key()] = self.value(2)
            else:
                body[r.choice(["name", "preset", "toml", "queue"])] = self.value(2)
            return body
        body = {}
        for field, make in (("name", self.text), ("preset", lambda: r.choice(["demo", "april", self.text()])),
                            ("overrides", self.overrides), ("toml", self.toml),
                            ("queue", lambda: r.choice([None, "", "training", self.text()]))):
            if r.random() < 0.5:
                body[field] = make() if r.random() < 0.8 else self.value()
        if r.random() < 0.2:
            body[self.text()] = self.value()
        return body

    def annotate_body(self):
        r = self.r
        body = {}
        if r.random() < 0.6:
            body["note"] = self.text() if r.random() < 0.7 else self.value()
        if r.random() < 0.6:
            body["tags"] = ([self.text()[:40] for _ in range(r.randrange(0, 25))] if r.random() < 0.6
                            else self.value())
        if r.random() < 0.4:
            body["archived"] = r.choice([True, False, "true", 1, None])
        if r.random() < 0.15:
            body[self.text()] = 1
        return body

    def knobs_body(self):
        r = self.r
        tunable = [p.name for p in config_mod.knobs()]
        return {r.choice(tunable) if r.random() < 0.6 else self.key(): self.value(2)
                for _ in range(r.randrange(0, 5))}

    def raw(self, body) -> bytes | str:
        """The body as sent: usually JSON; sometimes broken, deep, huge or not UTF-8."""
        r = self.r
        kind = r.random()
        if kind < 0.62:
            return json.dumps(body)
        if kind < 0.7:
            n = r.choice([40, 1000, 50_000])
            return "[" * n + "]" * n if r.random() < 0.5 else '{"a":' * n + "1" + "}" * n
        if kind < 0.76:
            return json.dumps(body)[: r.randrange(0, 40)]
        if kind < 0.82:
            return bytes(r.randrange(256) for _ in range(r.randrange(1, 64)))
        if kind < 0.86:
            return b'{"name": "\xed\xa0\x80", "note": "\xff"}'
        if kind < 0.9:
            return r.choice(['{"optim.lr": NaN}', '{"a": Infinity}', "null", "[]", '"x"', "1" * 5000,
                             '{"a": 1, "a": 2}', "{}", ""])
        if kind < 0.95:
            return json.dumps(self.value())
        return json.dumps({"name": "x", "overrides": {"optim.lr": 10 ** 400}, "note": "\ud800"})

    def query(self, names) -> str:
        r = self.r
        parts = []
        for name in names:
            if r.random() < 0.5:
                parts.append(f"{name}={self.query_value()}")
        if r.random() < 0.1:
            parts.append("keys=" + ",".join(f"k{i}" for i in range(r.choice([10, 300]))))
        return "&".join(parts)

    def query_value(self) -> str:
        r = self.r
        return r.choice(["", "0", "1", "-1", "9" * 30, "9" * 5000, "1e3", "%00", "a%00b", "%ED%A0%80",
                         "%FF", "all", "only", "running,queued", ",,,", "x" * 3000, "csv", "json",
                         "toml", "html", "optim.lr,reward/mean", "%2e%2e", "demo", "alice", "4",
                         "100000", "100001", "NaN"])


def endpoint(g: Gen, ids: list[int], tiny: dict):
    r = g.r
    rid = r.choice(ids)
    choice = r.randrange(14)
    if choice == 0:
        return r.choice(["GET", "POST", "DELETE"]), r.choice(["/api/knobs", "/api/presets"]), None
    if choice in (1, 2, 3):
        return "POST", "/api/runs", g.launch_body(tiny)
    if choice == 4:
        q = g.query(["status", "owner", "q", "tag", "archived", "limit"])
        return r.choice(["GET", "GET", "PUT"]), "/api/runs?" + q, None
    if choice == 5:
        return "PATCH", f"/api/runs/{rid}", g.annotate_body()
    if choice == 6:   # (DELETE never picks the ended run, which it would delete: ids[-1])
        method = r.choice(["GET", "DELETE", "PUT"])
        return method, f"/api/runs/{r.choice(ids[:-1]) if method == 'DELETE' else rid}", None
    if choice == 7:
        return "GET", f"/api/runs/{rid}/metrics?" + g.query(["after", "max_points", "keys"]), None
    if choice == 8:
        return "GET", f"/api/runs/{rid}/export?" + g.query(["format"]), None
    if choice in (9, 10):
        return "POST", f"/api/runs/{rid}/knobs", g.knobs_body()
    if choice == 12:   # the rollout inspector's filters
        return "GET", f"/api/runs/{rid}/samples?" + g.query(
            ["step", "min_step", "max_step", "min_reward", "max_reward", "min_len", "max_len",
             "finish", "q", "after", "limit"]), None
    if choice == 13:
        sid = r.choice([0, 1, 10 ** 18 - 1, 10 ** 30])
        return r.choice(["GET", "GET", "POST"]), f"/api/runs/{rid}/samples/{sid}", None
    return "POST", f"/api/runs/{rid}/{r.choice(['stop', 'pause', 'resume', 'kill'])}", g.value(1)


def auth_header(g: Gen, token: str):
    r = g.r
    kind = r.random()
    if kind < 0.8:
        return {}
    return {"HTTP_AUTHORIZATION": r.choice([f"Token {token}", "Token nope", "Token ", "Basic YTpi",
                                            "Bearer x", "Token " + "a" * 5000, "token " + token,
                                            "Token a\x00b", "Token " + token + "\x00"])}


def test_no_generated_request_gives_a_500(alice, bob, user, other_user, make_run, tiny):
    own = make_run(user, name="mine")
    ended = make_run(user, status="stopped", name="ended")
    others = make_run(other_user, name="bob's")
    token = ApiToken.objects.create(user=user).key
    ids = [own.pk, own.pk, own.pk, others.pk, 0, 10 ** 18 - 1, 10 ** 30, ended.pk]
    only = os.environ.get("RLPILOT_FUZZ_CASE")
    rng = random.Random(SEED)

    def keep_a_running_run():   # kill and delete must not leave the rest of the cases 404s
        nonlocal own
        if not Run.objects.filter(pk=own.pk).exists():
            own = make_run(user, name="mine again")
            ids[:3] = [own.pk] * 3
        Run.objects.filter(pk=own.pk).update(status="running", desired="run")

    for case in range(CASES):
        keep_a_running_run()
        g = Gen(random.Random(rng.random()))   # each case its own stream: reproducible alone
        method, path, body = endpoint(g, ids, tiny)
        raw = g.raw(body if body is not None else {})
        headers = auth_header(g, token)
        if only is not None and case != int(only):
            continue
        client = alice if g.r.random() < 0.85 else bob
        client.raise_request_exception = False
        kwargs = {"content_type": "application/json", **headers}
        if method == "GET":
            r = client.get(path, **headers)
        elif method == "DELETE":
            r = client.delete(path, **headers)
        else:
            r = getattr(client, method.lower())(path, raw, **kwargs)
        what = f"case {case}: {method} {path[:120]} body={str(raw)[:200]!r} headers={str(headers)[:80]}"
        # the first 500 ends the test (on PostgreSQL it also ends the test's transaction)
        assert r.status_code < 500, f"{what} -> {r.status_code}"
        if r.status_code >= 400:
            assert r["Content-Type"].startswith("application/json"), what
            payload = r.json()
            assert set(payload) == {"message", "errors"}, what
            assert len(r.content) < 12_000, f"{what}: a {len(r.content)}-byte error"
    # the pages still render for everyone after all that
    assert alice.get("/").status_code == 200 and bob.get("/").status_code == 200
    assert alice.get(f"/runs/{own.pk}/report/").status_code == 200
