"""`python -m trainer check RUN`: a run's invariants audited from its files."""
import json

from trainer import config as C
from trainer.cli.check import read_audit, text
from trainer.cli.main import main
from trainer.invariants.audit import latest_records


def write_run(d, cfg, metrics, samples):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.toml").write_text(C.to_toml(cfg))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))


def healthy_metrics(steps, bound=0):
    zero = {f"invariants/{r}": 0 for r in ("beyond_eta", "beyond_span", "trained_twice", "env_loss")}
    return [{"step": s, **zero, "invariants/bound": bound} for s in steps]


def row(step, group, index, staleness=0, trained=True):
    return {"step": step, "group": group, "index": index, "staleness": staleness, "trained": trained}


def by_rule(reports):
    return {r.rule: (r.recorded, r.rechecked) for r in reports}


def test_a_healthy_run_holds_everything(tmp_path, capsys):
    samples = [row(1, 0, 0), row(1, 0, 1), row(2, 1, 0), row(2, 0, 0, trained=False)]
    write_run(tmp_path, C.load("demo"), healthy_metrics([1, 2]), samples)
    assert main(["check", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("all held")
    assert "beyond_span            0        0" in out


def test_a_doctored_sample_file_is_caught_with_the_step_and_sample(tmp_path, capsys):
    # step 2 trains a sample 2 versions old at span 1, and step 3 trains group 0's sample again
    samples = [row(1, 0, 0), row(2, 1, 0, staleness=2), row(3, 0, 0)]
    write_run(tmp_path, C.load("april", ["april.max_version_span=1"]), healthy_metrics([1, 2, 3], 1), samples)
    assert main(["check", str(tmp_path)]) == 1
    reports = {r.rule: r for r in read_audit(tmp_path)}
    assert reports["beyond_span"].rechecked == 1 and reports["beyond_span"].samples == ["2:1/0"]
    assert reports["trained_twice"].rechecked == 1
    assert reports["trained_twice"].samples == ["3:0/0 (trained at step 1 too)"]
    assert "broken: beyond_span, trained_twice" in capsys.readouterr().out


def test_the_run_s_own_figures_count_and_the_bound_in_force_is_each_step_s(tmp_path):
    metrics = healthy_metrics([1, 2, 3], bound=1)
    metrics[2]["invariants/bound"] = 3   # eta raised by a knob change before step 3
    metrics[1]["invariants/env_loss"] = 2
    samples = [row(3, 5, 0, staleness=3)]
    write_run(tmp_path, C.load("async", ["async.max_staleness=1"]), metrics, samples)
    reports = read_audit(tmp_path)
    assert by_rule(reports)["beyond_eta"] == (0, 0)
    env = next(r for r in reports if r.rule == "env_loss")
    assert (env.recorded, env.recorded_steps) == (2, [2])
    assert "env_loss               2        -  steps 2" in text(reports)


def test_a_resumed_run_s_records_again_supersede_and_are_no_repeat(tmp_path):
    # steps 1-3 recorded, the run resumed from its step-1 checkpoint and recorded 2-3 again
    samples = [row(1, 0, 0), row(2, 1, 0), row(3, 2, 0), row(2, 1, 0), row(3, 2, 0)]
    metrics = healthy_metrics([1, 2, 3]) + healthy_metrics([2, 3])
    assert [r["step"] for r in latest_records(samples)] == [1, 2, 3]
    write_run(tmp_path, C.load("demo"), metrics, samples)
    assert not any(r.broken for r in read_audit(tmp_path))


def test_a_run_without_figures_is_rechecked_against_its_config(tmp_path, capsys):
    write_run(tmp_path, C.load("demo"), [{"step": 1, "reward/mean": 0.5}], [row(1, 0, 0, staleness=1)])
    assert main(["check", str(tmp_path)]) == 1
    assert "beyond_span            -        1" in capsys.readouterr().out


def test_not_a_run_directory(tmp_path, capsys):
    assert main(["check", str(tmp_path / "nowhere")]) == 2
    assert "not a run directory" in capsys.readouterr().err
