"""The run's rollout engine, built from its config: the engine `rollout.engine` names (embedded,
its processes behind one pool, or SGLang), ending responses at the stop ids and strings, with
episodes around it when `episode.max_turns` > 1.

Assembling an engine reads the config, the model, the task's prompts and its verifiers: it sits
here, where a run is assembled (trainer/run/build.py calls `build_engine`), above every package
it draws on; trainer/engine/ holds the engines themselves.
"""
from __future__ import annotations

from pathlib import Path

from trainer.config import stop_strings
from trainer.engine import engine_dtype, generation_device
from trainer.episode.engine import Episodes
from trainer.episode.environments import Environment, parse_tools
from trainer.episode.interface import UserEnvironment, load_environment
from trainer.episode.tools import TOOLS
from trainer.episode.tools import stop_strings as tool_stop_strings
from trainer.episode.turns import TurnFormat
from trainer.models.loading import stop_token_ids
from trainer.models.lora import with_bases
from trainer.tasks import task_spec
from trainer.tasks.prompts import PromptRenderer


def build_engine(cfg, model, tokenizer, device, dtype, max_seq_len: int, *,
                 weights_dir: str | Path | None = None, adapter: dict | None = None):
    """The engine `cfg.rollout.engine` names.

    `dtype` is the trainer's; `rollout.dtype` other than "auto" sets the engine's own (the
    engine then samples from a policy that differs from the trainer's by that precision: the
    training–inference mismatch, trainer/algo/rollout_correction.py).
    embedded: an EmbeddedEngine over `model` on `device`/`dtype` with `cfg.rollout.max_slots`
    slots of `max_seq_len` positions, seeded with `cfg.run.seed`. On CUDA the KV cache is sized
    from free memory: at most max_slots, as many as fit in half the memory free now (and again
    each time it is reacquired after `release_memory()`).
    With `cluster.gen_procs` >= 1 the embedded engine decodes in that many child processes
    (`process.ProcessEngine`) behind one `pool.EnginePool` (balanced; a child that dies is
    restarted and its samples go on elsewhere), each with `async.worker_threads` torch threads
    and the engine's dtype; on CUDA member i decodes on cuda:(LOCAL_WORLD_SIZE + i) when that many
    GPUs are visible, else on the trainer's device. With gen_procs = 0, `async.enabled` and
    `async.worker = "process"` make it a pool of one.
    sglang: an SGLangEngine over `cfg.rollout.sglang_urls` (checked with /health now: raises
    EngineError when a server is unreachable, or when `rollout.dtype` is not "auto" and a server
    serves another dtype: its --dtype, from /server_info). New weights are broadcast over a
    torch.distributed group (`rollout.sglang_weight_sync = "distributed"`), else (or after that fails) written under
    `cfg.rollout.sglang_weights_dir`, else `weights_dir` (pass RUN_DIR/engine_weights), else a
    temporary folder; the servers must be able to read that path.
    Every engine stops a response at each stop token id (`trainer.models.loading.stop_token_ids`: the
    tokenizer's eos and the generation config's) and, with `rollout.stop`, at those strings
    (`trainer.engine.stops.StopStrings` wraps it then).
    With `episode.max_turns` > 1 the engine generates multi-turn episodes
    (`with_episodes` wraps it in `trainer.episode.engine.Episodes`, and a tool call's closing tag ends a turn).
    `adapter` (a LoRA run, embedded engine: `model` is the base): the adapters' factors
    (trainer/models/lora.py `adapter_update`), loaded at once; the generation processes' shared
    buffers hold room for them, so later updates carry the factors alone.
    """
    r = cfg.rollout
    dtype = engine_dtype(r.dtype, dtype)
    eos = stop_token_ids(model, tokenizer)  # the tokenizer's eos and the generation config's
    stops = stop_strings(r.stop)
    if cfg.episode.agents:   # agents answer the turns (trainer/agents/): a call ends a turn
        fmt = TurnFormat.for_renderer(PromptRenderer.from_config(cfg, tokenizer))
        calls = [s for s in tool_stop_strings(fmt.syntax, TOOLS) if s not in stops]
        engine = _engine(cfg, model, tokenizer, device, dtype, max_seq_len, weights_dir, eos,
                         stops + calls, adapter)
    elif cfg.episode.multi_turn:
        engine = with_episodes(cfg, tokenizer, lambda tool_stops: _engine(
            cfg, model, tokenizer, device, dtype, max_seq_len, weights_dir, eos,
            stops + [s for s in tool_stops if s not in stops], adapter))
    else:
        engine = _engine(cfg, model, tokenizer, device, dtype, max_seq_len, weights_dir, eos,
                         stops, adapter)
    if adapter:   # with the adapted layers' base at the trainer's precision, to merge from
        engine.update_weights(with_bases(model.state_dict(), adapter), 0)
    return engine


def _engine(cfg, model, tokenizer, device, dtype, max_seq_len, weights_dir, eos, stops,
            adapter=None):
    """The engine `rollout.engine` names, ending responses at `eos` ids and `stops` strings."""
    r = cfg.rollout
    if r.engine == "sglang":
        from trainer.engine.sglang import SGLangEngine, parse_urls

        urls = parse_urls(r.sglang_urls)
        return _with_stops(tokenizer, stops, SGLangEngine(
            urls, eos_token_ids=eos, model_config=model.config,
            weights_dir=r.sglang_weights_dir or weights_dir,
            timeout_s=r.sglang_timeout_s, max_inflight=r.max_slots * len(urls),
            weight_sync=r.sglang_weight_sync, down_timeout_s=r.sglang_down_timeout_s,
            dtype=r.dtype))
    if r.engine != "embedded":
        raise ValueError(f"rollout.engine: unknown engine {r.engine!r}")
    on_cuda = getattr(device, "type", str(device)) == "cuda"
    slots = dict(max_slots="auto" if on_cuda else r.max_slots, slots_cap=r.max_slots,
                 park_tokens=cfg.engine.kv_park_tokens,
                 prompt_cache_tokens=cfg.engine.prompt_cache_tokens)
    procs = cfg.cluster.gen_procs or (cfg.async_.enabled and cfg.async_.worker == "process")
    if procs:
        return _with_stops(tokenizer, stops, _process_pool(
            model, int(procs), eos_token_ids=eos, max_seq_len=max_seq_len, seed=cfg.run.seed,
            device=device, dtype=dtype, threads=cfg.async_.worker_threads, stops=stops,
            tokenizer=tokenizer, adapter=adapter, **slots))
    from trainer.engine.embedded import EmbeddedEngine

    return _with_stops(tokenizer, stops, EmbeddedEngine(
        model, eos_token_ids=eos, kv_memory_fraction=0.5, max_seq_len=max_seq_len,
        seed=cfg.run.seed, device=device, dtype=dtype, **slots))


def with_episodes(cfg, tokenizer, make_engine) -> Episodes:
    """The run's engine with episodes: `make_engine(tool_stops)` builds the inner engine, ending
    responses also at the closing tags of the offered tools' calls. `episode.environment` names
    your own environment class; else the built-in one (tools, feedback) answers."""
    e = cfg.episode
    fmt = TurnFormat.for_renderer(PromptRenderer.from_config(cfg, tokenizer))
    tools = parse_tools(e.tools)
    if e.environment.strip():   # your own (trainer/episode/interface.py); checked at launch
        env = UserEnvironment(load_environment(e.environment), e.environment.strip())
    else:
        env = Environment(syntax=fmt.syntax, feedback=e.feedback, timeout_s=e.tool_timeout_s,
                          output_chars=e.tool_output_chars,
                          verify=lambda kind, answer, text: task_spec(kind).score(answer, text))
    inner = make_engine(tool_stop_strings(fmt.syntax, tools) if tools else [])
    return Episodes(inner, tokenizer, env, fmt, max_turns=e.max_turns, workers=e.tool_workers)


def _process_pool(model, size: int, *, device, seed: int, adapter=None, **kwargs):
    """An EnginePool of `size` ProcessEngines; member i on generation_device(device, i, size).
    `adapter`: LoRA factors whose room each member's shared buffer holds beside the weights."""
    from trainer.engine.pool import EnginePool
    from trainer.engine.process import ProcessEngine

    first = {**model.state_dict(), **adapter} if adapter else None

    def member(index: int, member_seed: int, weights):
        return ProcessEngine(model, seed=member_seed, weights=first if weights is None else weights,
                             device=generation_device(device, index, size), **kwargs)

    return EnginePool(member, size, seed=seed)


def _with_stops(tokenizer, stops: list[str], engine):
    """`engine`, ending responses at `rollout.stop` strings too when there are any
    (trainer/engine/stops.py)."""
    if not stops:
        return engine
    from trainer.engine.stops import StopStrings

    return StopStrings(engine, tokenizer, stops)
