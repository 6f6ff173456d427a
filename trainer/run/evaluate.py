"""Held-out evaluation: one sampled (or greedy) answer per held-out problem, scored."""
from __future__ import annotations

import time

from trainer.engine.base import RolloutEngine, Sample, SamplingParams
from trainer.episode.engine import final_turn, new_episode


def evaluate(engine: RolloutEngine, tokenizer, problems, score_batch, *, temperature: float,
             max_new_tokens: int, tools: tuple[str, ...] | None = None) -> dict:
    """`score_batch(problems, completions) -> list[float]`. Returns accuracy (share of answers
    scoring 1), mean reward, mean response length and the time taken; with `tools` (multi-turn
    runs) the problems are episodes, scored on their last model turn, and the share of them that
    called a tool and their mean number of turns are returned too."""
    t0 = time.monotonic()
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    samples = [Sample(tokenizer(p.prompt).input_ids, params, meta={"i": i})
               for i, p in enumerate(problems)]
    if tools is not None:
        for s, p in zip(samples, problems):
            s.meta["episode"] = new_episode(p, tools)
    engine.generate(samples)
    completions = [tokenizer.decode(final_turn(s), skip_special_tokens=True) for s in samples]
    scores = score_batch(problems, completions)
    n = len(problems)
    out = {"accuracy": sum(1 for r in scores if r >= 1.0) / n,
           "reward_mean": sum(scores) / n,
           "response_len_mean": sum(s.model_tokens for s in samples) / n,   # the model's
           "n": n, "seconds": time.monotonic() - t0}
    if tools is not None:
        episodes = [s.meta["episode"] for s in samples]
        out["tool_use_rate"] = sum(1 for e in episodes if e["tool_calls"]) / n
        out["turns_mean"] = sum(e["turns"] for e in episodes) / n
    return out
