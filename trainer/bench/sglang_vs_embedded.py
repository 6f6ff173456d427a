"""bench engine --engine sglang: the embedded engine against a real SGLang server (the one
`make sglang` installs) on the same model, prompts and CPU threads: useful tokens/s side by
side, and the seconds per training step of a small run with each engine.

Workload: `--prompts` arithmetic questions ("What is a + b?", seeded) in the model's chat
template, greedy by default (`--temperature`), at most `--max-new-tokens` each, `--slots` in flight
for both (the embedded engine's slots, the SGLang client's `max_inflight`). Useful tokens: every
generated token, up to and including the end-of-sequence token. Both in float32 with `--threads`
threads (default 1): torch's for the embedded engine, OMP_NUM_THREADS for the server. The two run
interleaved `--reps` times (medians, and every run); the server's start-up is reported apart.
`outputs_agree`: the share of prompts whose greedy answers are the same token for token.

Training: `--train-steps` steps (default 2) of the smollm2-math preset shrunk to 2 prompts x 2
samples of at most 32 tokens, with each engine; the medians of `timing/step_s`, `timing/gen_s`
and `timing/weight_sync_s` after the first step (which pays for warm-ups). `--model auto` =
var/models/smollm2-135m-instruct (`python -m trainer import-gguf smollm2`).
"""
from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

SMOLLM2_DIR = Path(__file__).resolve().parents[2] / "var" / "models" / "smollm2-135m-instruct"


def _prompts(tok, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        out.append(tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}],
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=False))
    return out


def _generate(engine, prompts, args) -> tuple[list[list[int]], float]:
    from trainer.engine.base import Sample, SamplingParams

    samples = [Sample(list(p), SamplingParams(temperature=args.temperature,
                                              max_new_tokens=args.max_new_tokens))
               for p in prompts]
    t0 = time.perf_counter()
    engine.generate(samples)
    return [s.response_ids for s in samples], time.perf_counter() - t0


def _train_step_seconds(model_dir: Path, engine_overrides: list[str], args, log) -> dict | None:
    if args.train_steps <= 0:
        return None
    from trainer import config as C
    from trainer.observe.metrics import MemorySink
    from trainer.run.runner import Runner

    cfg = C.load("smollm2-math", [
        f"model.path={model_dir}", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
        "rollout.max_response_len=32", "rollout.max_slots=8", "algo.skip_zero_adv=false",
        "run.reward_workers=0", f"model.threads={args.threads or 1}", "run.eval_every=0",
        "run.checkpoint_every=0", f"run.max_steps={args.train_steps}", f"run.seed={args.seed}",
        *engine_overrides])
    sink = MemorySink()
    with tempfile.TemporaryDirectory(prefix="rlpilot-bench-") as run_dir:
        with Runner(cfg, run_dir, sink=sink, system_telemetry=False) as r:
            r.run()
    steps = sink.series("timing/step_s")
    later = steps[1:] or steps
    log(f"  training: {', '.join(f'{x:.1f}' for x in steps)} s per step")
    def median_after_first(key):
        xs = sink.series(key)
        return round(statistics.median(xs[1:] or xs or [0.0]), 2)

    return {"step_s": round(statistics.median(later), 2), "runs": [round(x, 2) for x in steps],
            "gen_s": median_after_first("timing/gen_s"),
            "weight_sync_s": median_after_first("timing/weight_sync_s")}


def run(args, log=print) -> dict:
    from trainer.engine.embedded import EmbeddedEngine
    from trainer.engine.sglang import SGLangEngine
    from trainer.engine.sglang.server import SGLangServer
    from trainer.models.loading import load_model, load_tokenizer, stop_token_ids

    threads = args.threads or 1
    torch.set_num_threads(threads)
    model_dir = SMOLLM2_DIR if args.model in ("auto", "builtin") else Path(args.model)
    model = load_model(str(model_dir), torch.device("cpu"), torch.float32).eval()
    tok = load_tokenizer(str(model_dir))
    eos = stop_token_ids(model, tok)
    prompts = _prompts(tok, args.prompts, args.seed)
    max_seq_len = max(len(p) for p in prompts) + args.max_new_tokens + 1
    reps = max(args.reps, 1)
    log(f"bench engine --engine sglang: {model_dir.name} on cpu (float32), {len(prompts)} prompts, "
        f"{args.slots} in flight, {threads} thread(s), {reps} interleaved runs")

    t0 = time.perf_counter()
    server = SGLangServer(model_dir, threads=threads).start()
    startup_s = time.perf_counter() - t0
    log(f"  SGLang server up in {startup_s:.0f} s at {server.url}")
    try:
        client = SGLangEngine(server.url, eos_token_ids=eos, max_inflight=args.slots)
        runs: dict[str, list[dict]] = {"embedded": [], "sglang": []}
        answers: dict[str, list] = {}
        for _warm in range(1):   # first calls pay for allocations on both sides
            _generate(client, prompts[:2], _Short(args))
        for rep in range(reps):
            for name in ("embedded", "sglang"):
                if name == "embedded":
                    eng = EmbeddedEngine(model, eos_token_ids=eos, max_slots=args.slots,
                                         max_seq_len=max_seq_len, seed=args.seed)
                    resp, secs = _generate(eng, prompts, args)
                    eng.close()
                else:
                    resp, secs = _generate(client, prompts, args)
                answers.setdefault(name, resp)
                useful = sum(len(r) for r in resp)
                runs[name].append({"useful_tokens": useful, "seconds": round(secs, 2),
                                   "useful_tokens_per_s": round(useful / max(secs, 1e-9), 1)})
                log(f"  run {rep + 1}/{reps} {name}: {useful} useful tokens in {secs:.2f}s = "
                    f"{useful / max(secs, 1e-9):.1f}/s")
        client.close()
        train = {"embedded": _train_step_seconds(model_dir, [], args, log),
                 "sglang": _train_step_seconds(model_dir, ["rollout.engine=sglang",
                                                           f"rollout.sglang_urls={server.url}"],
                                               args, log)}
    finally:
        server.stop()
    med = {k: statistics.median(r["useful_tokens_per_s"] for r in v) for k, v in runs.items()}
    agree = sum(a == b for a, b in zip(answers["embedded"], answers["sglang"])) / len(prompts)
    result = {"model": str(model_dir), "device": "cpu", "dtype": "float32", "threads": threads,
              "prompts": len(prompts), "slots": args.slots,
              "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "reps": reps, "sglang_startup_s": round(startup_s, 1),
              "embedded": {"useful_tokens_per_s": round(med["embedded"], 1), "runs": runs["embedded"]},
              "sglang": {"useful_tokens_per_s": round(med["sglang"], 1), "runs": runs["sglang"]},
              "ratio": {"sglang_over_embedded": round(med["sglang"] / max(med["embedded"], 1e-9), 2)},
              "outputs_agree": round(agree, 3), "train_step": train}
    log(f"  useful tokens/s: embedded {med['embedded']:.1f}, SGLang {med['sglang']:.1f} "
        f"({result['ratio']['sglang_over_embedded']}x); greedy answers agree on {agree:.0%}")
    return result


class _Short:
    """args with a short generation (the warm-up)."""

    def __init__(self, base):
        self.__dict__.update(vars(base))
        self.max_new_tokens = 8
