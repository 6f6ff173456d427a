"""Command line: `python -m trainer COMMAND ...`.

  run PRESET_OR_FILE [--set k=v ...] [--out DIR] [--resume DIR]   train, with a progress display
  run --fork RUN_DIR --from-step N [--set k=v ...] [--out DIR]     a new run from RUN_DIR's
                                                    checkpoint at step N, with other settings
                                                    (cluster.train_procs=K > 1: K processes, torchrun)
  control RUN_DIR (--set k=v ... | --pause | --resume | --stop)   steer a running run
  knobs [--json]                                                   the parameter schema
  presets [--json]                                                 shipped presets (what an opt-in one needs)
  reward --dataset D.jsonl --completions C.jsonl                   score completions
  warmup [--tools] [--out DIR] [--steps N]                         rebuild a built-in model (--tools:
                                                    builtin-tools, warmed up on the calculator task)
  bench learn|... [--json]                                         benchmarks
  docs config [--write | --check]                                  docs/configuration.md
  samples RUN_DIR [--step N] [--worst | --longest]                 what the model wrote
  advise RUN_DIR|EXPORT.json [--window N] [--json]                 the pilot's advice (docs/pilot.md)
  check RUN_DIR [--json]                                           audit a run's invariants (docs/invariants.md)
  import-gguf FILE [OUT_DIR]                                       a GGUF model -> a local HF directory
  sglang-server --model DIR [--port P]                             a real SGLang server (make sglang)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from trainer import config as config_mod
from trainer.run import checkpoint


def _cmd_run(args) -> int:
    from trainer.cluster import distributed

    if args.autopilot is not None:   # shorthand of --set pilot.autopilot=RULES
        args.set.append(f"pilot.autopilot={args.autopilot}")
    if args.fork or args.from_step is not None:
        _fork(args)   # from here on, the child is resumed like any run
    relaunched = _relaunch_under_torchrun(args)
    if relaunched is not None:
        return relaunched
    from trainer.cluster.launch import die_with_launcher

    die_with_launcher()   # a rank of the torchrun the lines above started: it dies with torchrun
    ok = False
    try:
        rc = _run(args)
        ok = rc == 0  # an interrupted rank may be alone: no barrier then
    finally:
        size = distributed.destroy(sync=ok)  # leave the process group (torchrun)
    if size > 1:
        distributed.exit_process(rc)
    return rc


def _fork(args) -> None:
    """--fork RUN_DIR --from-step N: make the child's run directory (trainer/run/fork.py), then turn
    `args` into `--resume CHILD` with the same --set (torchrun's ranks get that command)."""
    from trainer.run import fork

    if not args.fork or args.from_step is None:
        raise config_mod.ConfigError({"--fork": "give both --fork RUN_DIR and --from-step N"})
    if args.resume or args.config:
        raise config_mod.ConfigError({"--fork": "a fork starts from RUN_DIR's checkpoint: give no "
                                      "preset and no --resume with it"})
    parent = Path(args.fork)
    out = args.out or f"runs/{parent.name}-fork{args.from_step}-{time.strftime('%Y%m%d-%H%M%S')}"
    child = fork.fork_run_dir(parent, args.from_step, out, args.set, overwrite=args.overwrite)
    print(f"forked {parent} at step {args.from_step} into {child}", flush=True)
    args.resume, args.fork, args.from_step = str(child), None, None
    args.argv = ["run", "--resume", str(child)] + [x for s in args.set for x in ("--set", s)]


def _requested_train_procs(args) -> int:
    """cluster.train_procs of the run `args` describe (1 when its config does not load: _run
    then says why)."""
    try:
        if args.resume:
            saved = config_mod.loads_toml((Path(args.resume) / "config.toml").read_text())
            return config_mod.apply_overrides(saved, args.set).cluster.train_procs
        return config_mod.load(args.config, args.set).cluster.train_procs if args.config else 1
    except (config_mod.ConfigError, OSError):
        return 1


def _relaunch_under_torchrun(args) -> int | None:
    """`run` asking for cluster.train_procs = K > 1 outside torchrun (WORLD_SIZE unset): the same
    command under torchrun with K processes on this machine, as a child that dies with this
    process (trainer/cluster/launch.py); returns its exit status. None: train in this process."""
    import os

    if "WORLD_SIZE" in os.environ:
        return None
    procs = _requested_train_procs(args)
    if procs <= 1:
        return None
    from trainer.cluster import launch

    argv = list(args.argv)
    if not args.resume and not args.out:   # named here, so that a failure can point at it
        args.out = f"runs/{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        argv += ["--out", args.out]
    proc = launch.TorchrunProcess(launch.torchrun_argv(["-m", "trainer", *argv], procs)).start()
    print(f"cluster.train_procs={procs}: training under torchrun (pid {proc.pid})", flush=True)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:   # torchrun runs in a session of its own: Ctrl-C reaches only us
        proc.stop()
        return 130
    if rc != 0:   # which rank, how, in which step, and where a resume continues
        run_dir = Path(args.resume or args.out)
        saved = checkpoint.latest_step(run_dir) if run_dir.is_dir() else None
        why = proc.failure(last_step=_last_step(run_dir), checkpoint_step=saved,
                           without_checkpoint="no checkpoint was written: run it again from the start")
        again = f"\n(python -m trainer run --resume {run_dir})" if saved is not None else ""
        print(f"run failed: {why}{again}", file=sys.stderr, flush=True)
    return rc


def _last_step(run_dir: Path) -> int | None:
    """The step of the last row a run directory's metrics.jsonl holds (None before the first;
    after a resume, the rows of the steps trained again come last)."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:   # its end is enough
            f.seek(max(f.seek(0, 2) - 65536, 0))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    steps = []
    for line in lines:
        try:
            steps.append(json.loads(line).get("step"))
        except (ValueError, AttributeError):   # a line cut by the seek or by the kill
            continue
    return next((s for s in reversed(steps) if isinstance(s, int)), None)


def _run(args) -> int:
    from trainer.cluster import distributed
    from trainer.observe.metrics import ConsoleSink, JsonlSink, MetricsSink, MultiSink
    from trainer.run import state as run_state
    from trainer.run.controls import ControlSource, FileControlSource
    from trainer.run.runner import RunFailed, Runner
    from trainer.run.state import prepare_run_dir

    if args.resume:
        run_dir = Path(args.resume)
        saved = run_dir / "config.toml"
        if not saved.is_file():
            raise config_mod.ConfigError({"--resume": f"{run_dir} has no config.toml: not a run directory"})
        cfg = config_mod.apply_overrides(config_mod.loads_toml(saved.read_text()), args.set)
        overridden = {config_mod.parse_override(s)[0] for s in args.set}
        if args.set and checkpoint.list_checkpoints(run_dir):   # what the checkpoint cannot carry
            latest = checkpoint.latest(run_dir)
            problems = run_state.carry_problems(json.loads((latest / "state.json").read_text()),
                                                cfg, latest)
            if problems:
                raise config_mod.ConfigError(problems)
        _require_sandbox(cfg)
    else:
        if not args.config:
            raise config_mod.ConfigError({"config": "name a preset or a .toml file (presets: "
                                          + ", ".join(config_mod.preset_names()) + ")"})
        cfg = config_mod.load(args.config, args.set)
        from trainer.models.loading import require_model_dir
        require_model_dir(cfg.model.path, engine=cfg.rollout.engine)  # before any run directory
        _require_sandbox(cfg)
        from trainer.run import warm_start
        warm_start.check(cfg)   # a greso.warm_start source that cannot be used: refused by name
        world = distributed.init(cfg.model.device)  # torchrun: one of K processes
        out = args.out or f"runs/{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        # rank 0 prepares the directory (and names it: the default holds the time)
        run_dir = Path(world.main_only(lambda: str(prepare_run_dir(out, overwrite=args.overwrite))))
        overridden = set()
    world = distributed.init(cfg.model.device)
    if world.is_main:  # the other ranks report through rank 0
        sink = MultiSink([JsonlSink(run_dir), ConsoleSink(cfg.run.max_steps)])
        controls = FileControlSource(run_dir)
        print(f"run directory: {run_dir}" + (f" ({world.size} processes)" if world.size > 1
                                              else ""), flush=True)
    else:
        sink, controls = MetricsSink(), ControlSource()
    runner = Runner(cfg, run_dir, sink=sink, controls=controls,
                    resume=bool(args.resume), keep_knobs=overridden)
    if world.is_main and runner.cfg.episode.agents:   # where agents call (docs/agents.md)
        from trainer.agents.endpoint import ADDRESS_FILE, TOKEN_ENV, read_address
        address = read_address(run_dir)
        print(f"agents' endpoint: {address['base_url']} (token: "
              + (f"{run_dir / ADDRESS_FILE}" if "token" in address else f"${TOKEN_ENV}") + ")",
              flush=True)
    try:
        with runner:
            status = runner.run()
    except KeyboardInterrupt:
        print("interrupted; resume with: python -m trainer run --resume " + str(run_dir))
        return 130
    except RunFailed as e:   # e.g. every generation process given up: the cause, whole
        again = (f"\n(python -m trainer run --resume {run_dir})"
                 if checkpoint.latest_step(run_dir) is not None else "")
        print(f"run failed: {e}{again}", file=sys.stderr, flush=True)
        return 1
    finally:
        sink.close()
    if world.is_main:
        print(json.dumps({"status": status, **runner.summary()}))
    return 0


def _cmd_control(args) -> int:
    from trainer.run.controls import PAUSE, RESUME, SET_KNOBS, STOP, Command, send

    commands = []
    if args.set:
        knobs = dict(config_mod.parse_override(s) for s in args.set)
        for key, value in knobs.items():  # reject here what the trainer would reject later
            spec = config_mod.param_spec(key)
            if not spec.tunable:
                raise config_mod.ConfigError({key: "cannot change during a run; tunable keys: "
                                              + ", ".join(p.name for p in config_mod.knobs())})
            spec.coerce(value)
        commands.append(Command(SET_KNOBS, knobs=knobs))
    for flag, kind in (("pause", PAUSE), ("resume", RESUME), ("stop", STOP)):
        if getattr(args, flag):
            commands.append(Command(kind))
    if not commands:
        raise config_mod.ConfigError({"control": "give --set k=v, --pause, --resume or --stop"})
    for c in commands:
        send(args.run_dir, c)
        print(f"sent {c.kind} {c.knobs or ''} (id {c.id})".rstrip())
    return 0


def _cmd_knobs(args) -> int:
    specs = config_mod.schema() if args.all else config_mod.knobs()
    if args.json:
        print(json.dumps([p.as_json() for p in specs], indent=2))
        return 0
    for p in specs:
        flag = " [tunable]" if p.tunable else ""
        print(f"{p.name} = {p.as_json()['default']!r}  ({p.allowed()}){flag}\n    {p.help}")
    return 0


def _cmd_presets(args) -> int:
    """Each preset; an opt-in one says what it needs (config.preset_requires)."""
    names = config_mod.preset_names()
    if args.json:
        print(json.dumps({name: {"requires": config_mod.preset_requires(name),
                                 "config": config_mod.load(name).to_dict()} for name in names},
                         indent=2))
    else:
        for name in names:
            needs = config_mod.preset_requires(name)
            print(f"{name}: {needs}" if needs else name)
    return 0


def _cmd_warmup(args) -> int:
    from trainer.models.loading import BUILTIN, BUILTIN_TOOLS, builtin_dir
    from trainer.run.warmup import warmup, warmup_tools

    out = args.out or str(builtin_dir(BUILTIN_TOOLS if args.tools else BUILTIN))
    steps = {} if args.steps is None else {"steps": args.steps}  # else each warm-up's own default
    info = (warmup_tools if args.tools else warmup)(out, seed=args.seed, **steps)
    print(json.dumps({"out": out, **info}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="train")
    r.add_argument("config", nargs="?", help="preset name or .toml file")
    r.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    r.add_argument("--out", help="run directory (default runs/<preset>-<time>)")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    r.add_argument("--fork", metavar="RUN_DIR", help="start a NEW run (--out) from RUN_DIR's "
                   "checkpoint at --from-step, with its config plus --set")
    r.add_argument("--from-step", type=int, metavar="N", help="the checkpoint step --fork starts from")
    r.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    r.add_argument("--autopilot", metavar="RULES", help="let the autopilot apply the advice of these "
                   "rules itself, comma-separated (staleness, april, greso, health, mismatch; '' = "
                   "none): --set pilot.autopilot=RULES; its changes are knob_applied events in "
                   "events.jsonl")
    r.set_defaults(func=_cmd_run)

    c = sub.add_parser("control", help="steer a running run")
    c.add_argument("run_dir")
    c.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    c.add_argument("--pause", action="store_true")
    c.add_argument("--resume", action="store_true")
    c.add_argument("--stop", action="store_true")
    c.set_defaults(func=_cmd_control)

    k = sub.add_parser("knobs", help="print the parameter schema")
    k.add_argument("--all", action="store_true", help="every parameter, not only tunable ones")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=_cmd_knobs)

    pr = sub.add_parser("presets", help="list presets")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=_cmd_presets)

    w = sub.add_parser("warmup", help="rebuild a built-in model (supervised warm-up)")
    w.add_argument("--tools", action="store_true", help="the calculator-task model (model.path "
                   "'builtin-tools'): by-hand sums and calculator calls")
    w.add_argument("--out", help="directory (default: the shipped trainer/assets/builtin-sum, "
                   "or builtin-tools with --tools)")
    w.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default: 1000, or 1500 with --tools)")
    w.add_argument("--seed", type=int, default=0)
    w.set_defaults(func=_cmd_warmup)

    from trainer import bench
    from trainer.cli import advise, check, cost, docs, estimate, export, reward, samples
    from trainer.engine.sglang import server as sglang_server
    from trainer.models import gguf_import
    gguf_import.add_parser(sub)
    reward.add_parser(sub)
    samples.add_parser(sub)
    bench.add_parser(sub)
    docs.add_parser(sub)
    advise.add_parser(sub)
    check.add_parser(sub)
    cost.add_parser(sub)
    estimate.add_parser(sub)
    export.add_parser(sub)
    sglang_server.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv   # `run` re-launched under torchrun passes them on
    try:
        return args.func(args)
    except config_mod.ConfigError as e:
        for key, msg in e.errors.items():
            print(f"error: {key}: {msg}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError, checkpoint.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


def _require_sandbox(cfg) -> None:
    """A run that executes model-written code needs its sandbox here, and one with your own
    environment needs it to import and build: refused by name if not."""
    from trainer.episode.interface import launch_problems as environment_problems
    from trainer.sandbox.preflight import launch_problems
    problems = launch_problems(cfg)
    problems.update(environment_problems(cfg))   # episode.environment: imports, implements, builds
    if problems:
        raise config_mod.ConfigError(problems)
