"""bench agents: what a call through the agents' endpoint costs over the engine called directly.

One run's engine (the `agent` preset's built-in tools model, `episode.agents = true`), two ways,
interleaved (`--reps` rounds, the order reversed every other round):

- direct: `--concurrency` samples of the same prompt submitted to the engine and stepped to
  their end, `--calls` times;
- endpoint: `--concurrency` threads of the real `openai` client, each calling
  /v1/chat/completions `--calls` times (a new session each: a first call), while a thread serves
  the endpoint (`AgentDriver.serve`, as a step does).

Per way: generated tokens per second (the engine's tokens over the wall time) and the median
wall ms of one call, and the decode steps it took (calls that arrive apart fill fewer slots per
step); `ratio` is endpoint over direct (tokens/s: < 1 is slower). Both step the engine from a
thread of their own, with one torch thread (`model.threads = 1`). The endpoint's
work per call is HTTP and JSON, rendering the prompt with the chat template, and decoding the
completion into a reply.
"""
from __future__ import annotations

import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

NAME = "agents"
HELP = "the agents' endpoint's overhead per call against the engine called directly (tokens/s)"
PROMPT = "[12,30,7]="


def add_arguments(p) -> None:
    p.add_argument("--reps", type=int, default=3, help="interleaved rounds")
    p.add_argument("--calls", type=int, default=8, help="calls per thread (or per batch) and round")
    p.add_argument("--concurrency", type=int, default=4, help="calls at once")
    p.add_argument("--max-tokens", type=int, default=48, help="each call's max_tokens")


def run(args, log=print) -> dict:
    import openai

    from trainer import config as config_mod
    from trainer.agents.endpoint import read_address
    from trainer.engine.base import Sample, SamplingParams
    from trainer.observe.metrics import MemorySink
    from trainer.rollout.base import StepCounts
    from trainer.run.runner import Runner

    cfg = config_mod.load("agent", ["episode.agents=true", "run.eval_every=0", "model.threads=1",
                                    "run.checkpoint_every=0", "run.reward_workers=0"])
    figures = {"direct": {"tokens_per_s": [], "call_ms": []},
               "endpoint": {"tokens_per_s": [], "call_ms": []}}
    with tempfile.TemporaryDirectory(prefix="rlpilot-bench-") as d, \
            Runner(cfg, d, sink=MemorySink(), system_telemetry=False) as runner:
        driver, engine, tok = runner.rollout, runner.engine, runner.tokenizer
        address = read_address(d)
        client = openai.OpenAI(base_url=address["base_url"], api_key=address["token"], max_retries=0)
        prompt = tok(PROMPT, add_special_tokens=False).input_ids
        params = SamplingParams(temperature=cfg.rollout.temperature, top_p=1.0,
                                max_new_tokens=cfg.rollout.max_response_len,
                                segment_max_tokens=args.max_tokens)
        stop = threading.Event()

        def serve():
            while not stop.is_set():
                if not driver.serve(1 << 30, StepCounts()):
                    driver.sessions.wait(0.005)

        def direct() -> tuple[int, list[float]]:
            tokens, ms = 0, []
            for _ in range(args.calls):
                t = time.monotonic()
                batch = [Sample(list(prompt), params) for _ in range(args.concurrency)]
                engine.submit(batch)
                while engine.num_pending:
                    engine.step()
                engine.drop_cache([s.request_id for s in batch])
                ms += [1e3 * (time.monotonic() - t)] * len(batch)
                tokens += sum(len(s.response_ids) for s in batch)
            return tokens, ms

        def one_agent(k: int) -> tuple[int, list[float]]:
            tokens, ms = 0, []
            for c in range(args.calls):
                t = time.monotonic()
                r = client.chat.completions.create(model="policy", max_tokens=args.max_tokens,
                                                   messages=[{"role": "user", "content": PROMPT}],
                                                   user=f"bench-{len(ms)}-{k}-{c}-{time.monotonic_ns()}")
                ms.append(1e3 * (time.monotonic() - t))
                tokens += r.usage.completion_tokens
            return tokens, ms

        def endpoint() -> tuple[int, list[float]]:
            server = threading.Thread(target=serve, daemon=True)
            stop.clear()
            server.start()
            try:
                with ThreadPoolExecutor(args.concurrency) as pool:
                    done = list(pool.map(one_agent, range(args.concurrency)))
            finally:
                stop.set()
                server.join()
            return sum(t for t, _ in done), [m for _, ms in done for m in ms]

        def direct_off_main() -> tuple[int, list[float]]:
            """On a thread of its own, as the endpoint's engine steps (a thread's torch threads
            are its own: on a loaded machine the main thread's two were 10x slower)."""
            with ThreadPoolExecutor(1) as one:
                return one.submit(direct).result()

        ways = {"direct": direct_off_main, "endpoint": endpoint}
        for r in range(args.reps + 1):   # round 0 warms both up, unrecorded
            for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                t, before = time.monotonic(), engine.stats.decode_steps
                tokens, ms = ways[name]()
                wall = time.monotonic() - t
                steps = engine.stats.decode_steps - before
                if r:
                    figures[name]["tokens_per_s"].append(tokens / wall)
                    figures[name]["call_ms"].append(statistics.median(ms))
                    log(f"round {r} {name:8s} {tokens / wall:8.1f} tokens/s  "
                        f"median call {statistics.median(ms):7.1f} ms  {tokens} tokens in "
                        f"{steps} decode steps")
        driver.close()
    out = {name: {k: round(statistics.median(v), 2) for k, v in f.items()}
           for name, f in figures.items()}
    out["ratio"] = {k: round(out["endpoint"][k] / out["direct"][k], 3) for k in out["direct"]}
    out["settings"] = {"reps": args.reps, "calls": args.calls, "concurrency": args.concurrency,
                       "max_tokens": args.max_tokens, "model": cfg.model.path}
    return out
