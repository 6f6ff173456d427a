"""What a run says of itself at its start and at its end, for the run page, the report and a person.

    start(...)            the run_started / run_resumed event's data: its precisions, what trains,
                          what each process holds, a resume's KV note, GRESO's warm start, the
                          agents' URL
    start_warnings(cfg)   the warnings said at every start and resume
    gave_up(e)            the GenerationGaveUp behind an error, or None
    lost_generation(...)  why a run whose generation processes were given up ends
"""
from __future__ import annotations

from pathlib import Path

from trainer.engine import rollout_precision
from trainer.engine.base import GenerationGaveUp
from trainer.models import lora
from trainer.rollout import april
from trainer.run import checkpoint
from trainer.sandbox.preflight import weak_isolation_warning


def start(cfg, step: int, *, device, dtype, engine, model, devices: dict,
          greso_warm: dict | None, rollout) -> dict:
    """The start event's data (`step` > 0: a resume)."""
    return {"max_steps": cfg.run.max_steps, "device": str(device),
            # the trainer's precision and the engine's (the mismatch metrics' cause)
            "model_dtype": str(dtype).removeprefix("torch."),
            "rollout_dtype": rollout_precision(engine, cfg.rollout.dtype, dtype),
            # what trains: every parameter, or LoRA's adapters (their file's bytes)
            **lora.sizes(model),
            # what each process holds, for the cost account (trainer/accounting/cost.py)
            "devices": devices,
            # a resume holds no KV cache: how its parked samples go on
            **({"kv_cache": april.resume_kv_note(cfg)} if step else {}),
            # how many prompts' GRESO history came from another run
            **({"greso_warm_start": greso_warm} if greso_warm else {}),
            # where the agents call (episode.agents; the token is never written)
            **({"agents_url": rollout.server.base_url} if cfg.episode.agents else {})}


def start_warnings(cfg) -> list[str]:
    """Said at every start and resume, as the run page and the report keep saying."""
    return list(filter(None, (weak_isolation_warning(cfg), lora.dropout_warning(cfg))))


def gave_up(e: BaseException) -> GenerationGaveUp | None:
    """The GenerationGaveUp behind `e` (the asynchronous worker's error wraps it), or None."""
    seen = set()
    while e is not None and id(e) not in seen:   # a chain may loop back
        if isinstance(e, GenerationGaveUp):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def lost_generation(lost: GenerationGaveUp, step: int, run_dir: Path) -> str:
    """Why the run ends when its generation processes were given up during `step`, for a
    person: which, how, after how many restarts, and where a resume continues."""
    saved = checkpoint.latest_step(run_dir)
    resume = (f"resume continues from the checkpoint at step {saved}" if saved is not None
              else "no checkpoint was written: a resume starts over")
    return f"{lost.during(step)}; {resume}"
