"""Held-out evaluation: one sampled (or greedy) answer per held-out problem, scored."""
from __future__ import annotations

import time

from trainer.engine.base import RolloutEngine, Sample, SamplingParams


def evaluate(engine: RolloutEngine, tokenizer, problems, score_batch, *, temperature: float,
             max_new_tokens: int) -> dict:
    """`score_batch(problems, completions) -> list[float]`. Returns accuracy (share of answers
    scoring 1), mean reward, mean response length and the time taken."""
    t0 = time.monotonic()
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    samples = [Sample(tokenizer(p.prompt).input_ids, params, meta={"i": i})
               for i, p in enumerate(problems)]
    engine.generate(samples)
    completions = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    scores = score_batch(problems, completions)
    n = len(problems)
    return {"accuracy": sum(1 for r in scores if r >= 1.0) / n,
            "reward_mean": sum(scores) / n,
            "response_len_mean": sum(len(s.response_ids) for s in samples) / n,
            "n": n, "seconds": time.monotonic() - t0}
