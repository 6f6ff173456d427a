"""Before a run: does it execute model-written code, and can its sandbox be set up here?

Asked by the command line before a run directory is made and by the dashboard at launch and on
the worker (webapp/dashboard/access/validation.py), so a run that needs the boundary is refused
with one message that names what is missing and how to get it, wherever it was launched. The
config is read by attribute (any object with the sections' fields), never imported.
"""
from __future__ import annotations

from trainer.sandbox import WEAK_WARNING, unavailable


def model_code_uses(cfg) -> list[str]:
    """What in `cfg` runs model-written code, in words (empty: nothing does)."""
    uses = []
    if cfg.data.task == "code":
        uses.append("the code reward (data.task = 'code')")
    if cfg.episode.multi_turn:
        tools = [t.strip() for t in (cfg.episode.tools or "").split(",")]
        if "python" in tools:
            uses.append("the python tool (episode.tools)")
        elif cfg.data.task in ("math", "code"):
            uses.append("the python tool, which a JSONL task's rows may offer")
    return uses


def launch_problems(cfg) -> dict[str, str]:
    """{"sandbox.isolation": why} when `cfg` runs model-written code behind a boundary this host
    cannot set up; {} otherwise."""
    uses = model_code_uses(cfg)
    if not uses or cfg.sandbox.isolation == "process":
        return {}
    why = unavailable(cfg.sandbox.isolation)
    if why is None:
        return {}
    return {"sandbox.isolation": (
        f"this run executes model-written code ({'; '.join(uses)}), and its isolation boundary "
        f"cannot be set up here: {why}. To run it with limits only, not a security boundary, "
        "set sandbox.isolation = 'process' (docs/sandbox.md)")}


def weak_isolation_warning(cfg) -> str | None:
    """The warning a run shows for as long as it runs model-written code without the boundary."""
    if cfg.sandbox.isolation == "process" and model_code_uses(cfg):
        return WEAK_WARNING
    return None
