"""GRESO warm start (greso.warm_start): a new run starts from another run's GRESO statistics for
the prompts they share; a resume keeps its own; a source whose ids mean other problems is
refused by name."""
import json
import shutil

import pytest
from helpers import TINY_RUN

from trainer import config as C
from trainer.config import GresoConfig
from trainer.observe.metrics import MemorySink
from trainer.rollout.greso import Decision, GresoFilter
from trainer.run import checkpoint
from trainer.run.runner import Runner

CORRECT, WRONG, MIXED = [1.0, 1.0], [0.0, 0.0], [1.0, 0.0]


def _source_filter():
    f = GresoFilter(p_easy=0.31, p_hard=0.62, seed=4)
    for step in range(1, 21):
        f.record("easy", step, CORRECT if step > 10 else MIXED)   # z 10, last at 20
        if step <= 15:
            f.record("hard", step, WRONG)                          # z 15, last at 15: age 5
        f.record("mixed", step, MIXED)
        f.record("theirs only", step, CORRECT)
    return f


def test_import_carries_shared_traces_and_p_with_their_ages():
    source = _source_filter()
    warm = GresoFilter(p_easy=0.5, p_hard=0.5, seed=4)
    n = warm.import_history(json.loads(json.dumps(source.state_dict())),
                            ["easy", "hard", "mixed", "ours only"])
    assert n == 3                                          # "ours only" has no history there
    assert (warm.p_easy, warm.p_hard) == (0.31, 0.62)
    assert warm.trace("theirs only") == []                 # not one of this run's prompts
    assert warm.trace("hard")[-1] == (-5, 0.0)             # the source's step 15 -> 15 - 20 + 0
    cfg = GresoConfig(forget_half_life=3)
    ids = ["easy", "hard", "mixed"] * 20
    theirs = [source.decide(pid, cfg) for pid in ids]
    ours = [warm.decide(pid, cfg) for pid in ids]
    assert ours == theirs                                  # kind, streak, keep prob, age, skip
    assert {d.age for d in ours if d.kind == "hard"} == {5}
    assert any(d.skip for d in ours) and not all(d.skip for d in ours if d.kind)
    assert warm.decide("ours only", cfg) == Decision(skip=False, kind=None, streak=0, keep_prob=1.0)


def test_the_new_runs_records_age_the_imported_ones():
    warm = GresoFilter()
    warm.import_history(_source_filter().state_dict(), ["hard"])
    warm.record("other", 3, MIXED)                         # the new run's step 3
    assert warm.age("hard") == 8                           # 5 at the source's end, 3 steps since


# -- whole runs ---------------------------------------------------------------------------------

RUN = [*TINY_RUN, "greso.enabled=true", "data.train_size=8", "rollout.max_response_len=32"]


def _runner(run_dir, *sets, resume=False):
    cfg = C.load("demo", [*RUN, *sets])
    return Runner(cfg, run_dir, sink=MemorySink(), system_telemetry=False, resume=resume)


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("warm") / "source"
    with _runner(d, "run.max_steps=3") as r:
        r.run()
    return d


def test_a_new_run_starts_from_the_source_runs_last_state(source_run, tmp_path):
    saved = checkpoint.load(checkpoint.latest(source_run))[1]["greso"]
    assert len(saved["traces"]) == 8                       # every prompt was rolled out
    with _runner(tmp_path / "warm", "run.max_steps=1", f"greso.warm_start={source_run}") as r:
        assert r.greso_warm["prompts"] == 8 and r.greso_warm["checkpoint_step"] == 3
        source = GresoFilter(seed=0)
        source.load_state_dict(saved)
        source._rng.setstate(r.greso._rng.getstate())      # the same draws: decisions compare
        for pid in sorted(saved["traces"]):
            assert r.greso.decide(pid, r.cfg.greso) == source.decide(pid, r.cfg.greso)
        r.run()
        started = next(e for e in r.sink.events if e["kind"] == "run_started")
        assert started["greso_warm_start"]["prompts"] == 8
        assert started["greso_warm_start"]["source"] == str(source_run)


def test_a_cold_run_has_no_history_and_says_nothing(tmp_path):
    with _runner(tmp_path / "cold", "run.max_steps=1") as r:
        assert r.greso_warm is None and r.greso.state_dict()["traces"] == {}
        r.run()
        started = next(e for e in r.sink.events if e["kind"] == "run_started")
        assert "greso_warm_start" not in started


def test_a_resumed_warm_run_keeps_its_own_state(source_run, tmp_path):
    src = tmp_path / "source-copy"
    shutil.copytree(source_run, src)
    warm = tmp_path / "warm"
    with _runner(warm, "run.max_steps=2", "run.checkpoint_every=2", f"greso.warm_start={src}") as r:
        r.run()
    own = checkpoint.load(checkpoint.latest(warm))[1]["greso"]
    shutil.rmtree(src)                                     # a resume never reads the source again
    with _runner(warm, "run.max_steps=3", resume=True) as r:
        assert r.greso_warm is None
        assert _same_filter(r.greso, own)


def _same_filter(greso, state):
    restored = GresoFilter()
    restored.load_state_dict(state)
    return greso.state_dict() == restored.state_dict()


@pytest.mark.parametrize("setup, message", [
    ("missing", "is not a directory: no such run"),
    ("not a run", "has no config.toml: not a run directory"),
    ("no checkpoint", "has no checkpoint yet"),
    ("other seed", "problem ids name different problems: run.seed is 0 there, 1 here"),
    ("other task", "data.task is 'sum' there, 'drift' here"),
])
def test_an_unusable_source_is_refused_by_name(source_run, tmp_path, setup, message):
    src, sets = tmp_path / "src", []
    if setup == "not a run":
        src.mkdir()
    elif setup == "no checkpoint":
        src.mkdir()
        shutil.copy(source_run / "config.toml", src / "config.toml")
    elif setup != "missing":
        src = source_run
        sets = ["run.seed=1"] if setup == "other seed" else ["data.task=drift"]
    with pytest.raises(C.ConfigError) as e:
        _runner(tmp_path / "new", "run.max_steps=1", f"greso.warm_start={src}", *sets)
    assert list(e.value.errors) == ["greso.warm_start"] and message in e.value.errors["greso.warm_start"]
