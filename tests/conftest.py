import os
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY_RUN

# Two cores are shared by the test process and any reward workers: keep torch to one thread
# so timings stay sane and results reproducible.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")



@pytest.fixture
def tiny_overrides():
    return list(TINY_RUN)


# --- real SGLang servers: one shared for the session, the others started ahead of their test ----
# Starting one costs 36-60 s on this machine. The float32 server is shared by every test that
# does not prove something about starting, flags or killing a server (tests/test_sglang_real.py,
# tests/web/test_web_sglang.py); a test that changes its weights puts the model's own back
# (sglang_original_weights_after). Each server a collected test will use (the fixtures named in
# STARTERS) starts in the background LOOKAHEAD_ITEMS tests before the first one that uses it,
# so its start-up overlaps the tests before (mostly one thread each on two cores) instead of
# adding to the run, without holding its memory for the whole session; a session without those
# tests starts nothing. (--sleep-on-idle: idle until its first user, a server spins no core.)
SMOLLM2_DIR = Path(__file__).resolve().parents[1] / "var" / "models" / "smollm2-135m-instruct"
LOOKAHEAD_ITEMS = 100


class _BackgroundStart:
    """`SGLangServer.start()` on a thread; `result()` waits for it and re-raises its error."""

    def __init__(self, server):
        self.server, self.error = server, None
        self.thread = threading.Thread(target=self._start, name="sglang-prestart", daemon=True)
        self.thread.start()

    def _start(self):
        try:
            self.server.start()
        except BaseException as e:   # handed to the first test that asks for the server
            self.error = e

    def result(self, timeout_s: float = 400.0):
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"the SGLang server started in the background is not up after "
                               f"{timeout_s:.0f} s (log {self.server.log_path})")
        if self.error is not None:
            raise self.error
        return self.server

    def discard(self):
        self.thread.join(400)
        self.server.stop()


def _float32_server(log_dir):
    from trainer.engine.sglang.server import SGLangServer

    return SGLangServer(SMOLLM2_DIR, threads=1, log_path=Path(log_dir) / "server.log")


def _float32_in_background():
    return _BackgroundStart(_float32_server(tempfile.mkdtemp(prefix="rlpilot-sglang-")))


# fixture -> what starts its server ahead of time (the fixture takes it from sglang_prestarted)
STARTERS = {
    "real_sglang_server": _float32_in_background,
    "second_sglang_server": _float32_in_background,   # the one test_sglang_real's two-server test kills
}
_first_use: dict[str, int] = {}    # fixture -> index of the first collected test using it
_item_index: dict[str, int] = {}
_prestarted: dict = {}


def _will_run(item) -> bool:
    """Not skipped by a mark (the redis pass skips embedded_only tests; a skipif whose condition
    is already decided)."""
    if item.get_closest_marker("skip"):
        return False
    return not any(m.args[:1] == (True,) or m.kwargs.get("condition") is True
                   for m in item.iter_markers("skipif"))


def pytest_collection_finish(session):
    """Plan the background starts: where each server's first user runs."""
    from trainer.engine.sglang.server import VENV

    if session.config.option.collectonly or not (VENV / "bin" / "python").is_file() \
            or not (SMOLLM2_DIR / "config.json").is_file():
        return
    for i, item in enumerate(session.items):
        _item_index[item.nodeid] = i
        if _will_run(item):
            for name in STARTERS:
                if name in getattr(item, "fixturenames", ()):
                    _first_use.setdefault(name, i)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    i = _item_index.get(item.nodeid)
    if i is None:
        return
    for name, first in list(_first_use.items()):
        if i >= first - LOOKAHEAD_ITEMS:
            del _first_use[name]
            _prestarted[name] = STARTERS[name]()


def pytest_sessionfinish(session):
    """What was started in the background and no test took (all deselected or failed early)."""
    for name in list(_prestarted):
        _prestarted.pop(name).discard()


@pytest.fixture(scope="session")
def sglang_prestarted():
    """The background starts of pytest_runtest_setup, by fixture name: the fixture named takes
    its entry (pop), or starts its server itself when there is none."""
    return _prestarted


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as `make sglang-model` writes it (imported here when absent)."""
    from trainer.models import gguf_import

    out = SMOLLM2_DIR
    assert out.name == gguf_import.SMOLLM2_DIR_NAME
    if not (out / "config.json").is_file():  # `make sglang-model` writes it (make test does)
        gguf_import.import_gguf(gguf_import.smollm2_gguf(download=True), out)
    return out


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="session")
def real_sglang_server(smollm2_dir, tmp_path_factory):
    """A float32 SGLang server (one OMP thread) serving SmolLM2: the one started in the background
    (STARTERS), else started now; stopped when the session ends, with no process of its
    group left."""
    pre = _prestarted.pop("real_sglang_server", None)
    srv = pre.result() if pre is not None else _float32_server(tmp_path_factory.mktemp("sglang")).start()
    pgid = srv.proc.pid   # start_new_session: the group's id is the server's pid
    try:
        yield srv
    finally:
        srv.stop()
        deadline = time.monotonic() + 15
        while not _group_gone(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert not srv.running and _group_gone(pgid), "a process of the SGLang server outlived stop()"


@pytest.fixture
def sglang_original_weights_after(real_sglang_server, smollm2_dir):
    """Put the model's own weights (version 0) back on the shared server after a test that
    changed them. The test is over: what still runs on the server (an answer the run's close
    aborted, still winding down) is aborted. An update refused meanwhile ("weights were updated,
    but the cache was not flushed because requests are still running") is made again once the
    server is idle (/flush_cache waits for that, up to its timeout)."""
    import requests

    from trainer.engine.base import EngineError
    from trainer.engine.sglang import SGLangEngine

    yield
    server = real_sglang_server
    eng = SGLangEngine(server.url)
    body = {"model_path": str(smollm2_dir), "weight_version": "0", "abort_all_requests": True}
    try:
        try:
            eng._call(eng.servers[0], "POST", "/update_weights_from_disk", body)
        except EngineError:
            requests.post(server.url + "/flush_cache", params={"timeout": 60}, timeout=90).raise_for_status()
            eng._call(eng.servers[0], "POST", "/update_weights_from_disk", body)
    finally:
        eng.close()
