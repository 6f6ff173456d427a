"""Helpers shared by the test files (imported as `helpers`; pytest puts tests/ on sys.path)."""
import sys

import pytest
import torch

from trainer.rollout import ledger

# the smallest run of the demo preset that still trains (one thread, no evaluation, no checkpoints)
TINY_RUN = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
            "rollout.max_response_len=64", "rollout.max_slots=16", "run.eval_every=0",
            "run.checkpoint_every=0", "run.reward_workers=0", "model.threads=1"]


def tiny_cli_run(out, *sets: str, preset: str = "demo") -> list[str]:
    """`python -m trainer run PRESET --out OUT` on a tiny run (responses of at most 48 tokens),
    `sets` after its settings (a later --set wins)."""
    cmd = [sys.executable, "-m", "trainer", "run", preset, "--out", str(out)]
    for s in [*TINY_RUN, "rollout.max_response_len=48", *sets]:
        cmd += ["--set", s]
    return cmd


def full_forward_logprobs(model, s, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of a sample's response tokens from one plain forward pass of `model`
    over prompt + response: the reference the engines are checked against."""
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)
    P = len(s.prompt_ids)
    return logp[P - 1:-1].gather(1, torch.tensor(s.response_ids).unsqueeze(1)).squeeze(1)


def sample_row(step: int, group: int = 0, index: int = 0, *, completion: str | None = None,
               prompt: str | None = None, length: int | None = None, reward: float | None = 1.0,
               score: float | None = None, finish: str = "stop", versions: tuple = (),
               staleness: int = 0, reward_status: str = "ok", reward_error: str = "",
               why: str = "group", advantage: float | None = 0.0, tis_weight: float | None = 1.0) -> dict:
    """One row as the trainer hands it to MetricsSink.samples(step, rows) (the rollout
    inspector): `length` tokens (one piece per token; default: the sum of `versions`, else a
    few), split into version `segments` by `versions` ((version, tokens), ...; default: all by
    version `step`)."""
    if completion is None:
        n = length if length is not None else (sum(k for _, k in versions) if versions
                                                else 4 + (group * 7 + index * 3 + step) % 12)
        pieces = [f"t{i} " for i in range(n)]
    else:
        pieces = list(completion) if length is None else [completion] + [""] * (length - 1)
    n = len(pieces)
    segments = [[v, k] for v, k in versions] if versions else [[step, n]]
    assert sum(k for _, k in segments) == n, (segments, n)
    score = reward if score is None else score
    return {"step": step, "group": group, "index": index,
            "prompt": prompt if prompt is not None else f"What is {group} + {step}?",
            "completion": "".join(pieces), "reward": reward, "score": score,
            "penalty": (reward - score) if reward is not None and score is not None else 0.0,
            "advantage": advantage, "length": n, "finish": finish, "segments": segments,
            "staleness": staleness, "tis_weight": tis_weight, "reward_status": reward_status,
            "reward_error": reward_error, "why": why, "tokens": pieces,
            "logprobs": [-0.1 * (i % 7) for i in range(n)]}


def tiny_hf_model(config_cls, max_positions: int = 512, **extra):
    """A two-layer Hugging Face causal LM of `config_cls` (Llama, Qwen2, Qwen3, ...) with random
    weights (seed 0): the architectures the embedded engine must match, at test size."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = config_cls(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                     tie_word_embeddings=False, **extra)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


class NoBell:
    """A doorbell that rings nobody: database sinks in tests that need no live socket."""

    def ring(self, run_id, seq):
        pass

    def close(self):
        pass


def check_rows(rows, waiting=0, generated=0, trained=0, dropped=0):
    """Each step: generated = trained + change in waiting + waste; the totals likewise."""
    for r in rows:
        assert r["rollout/waste/total"] == sum(r[f"rollout/waste/{x}"] for x in ledger.REASONS)
        assert r["rollout/tokens/generated"] == (r["rollout/tokens/trained"] + r["rollout/waste/total"]
                                                 + r["rollout/tokens/waiting"] - waiting)
        waiting = r["rollout/tokens/waiting"]
        generated += r["rollout/tokens/generated"]
        trained += r["rollout/tokens/trained"]
        dropped += r["rollout/waste/total"]
        assert r["rollout/tokens/generated_total"] == generated
        assert r["rollout/tokens/trained_total"] == trained
        assert generated == trained + waiting + dropped
        assert r["rollout/waste/share_total"] * generated == pytest.approx(dropped)
    return waiting, generated, trained, dropped


def new_weights(model, scale=1.05):
    """A deep copy of `model` with every parameter scaled: other weights to send an engine."""
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(scale)
    return other
