"""Every metric name rlpilot reports, declared once, with what it means; and the charts the
dashboard draws from them (the live page, the report, the offline export and the comparison
read `CHARTS` and `HISTOGRAM_AXES` from here, through the page's JSON).

Names follow verl/TRL habits: slash-separated, `section/quantity[/detail]`. A test runs every
preset and fails when a name is reported that is not declared here.
"""
from __future__ import annotations

import re

SCALARS: dict[str, str] = {
    # rewards
    "reward/mean": "mean reward of the step's scored samples (with penalties)",
    "reward/accuracy": "share of samples whose verifier score is full marks",
    "reward/errors": "rewards that raised (scored 0)",
    "reward/timeouts": "rewards that timed out (scored 0)",
    "eval/accuracy": "held-out accuracy", "eval/reward_mean": "held-out mean reward",
    "eval/response_len_mean": "held-out mean response length (tokens)",
    "eval/tool_use_rate": "held-out share of episodes that called a tool (multi-turn runs)",
    "eval/turns_mean": "held-out model turns per episode, mean (multi-turn runs)",
    # rollout
    "rollout/response_len/mean": "mean response length (tokens the model wrote)",
    "rollout/response_len/p50": "median response length", "rollout/response_len/p90": "p90 length",
    "rollout/response_len/max": "longest response",
    "rollout/truncated_ratio": "share of responses cut at max_response_len",
    "rollout/zero_var_ratio": "share of groups whose rewards are all equal (no signal)",
    "rollout/zero_var_ratio/all_correct": "share of all-correct groups",
    "rollout/zero_var_ratio/all_wrong": "share of all-wrong groups",
    "rollout/idle_slot_frac": "share of engine slots idle per decode step",
    "rollout/decode_steps": "engine decode steps", "rollout/gen_tokens": "tokens generated",
    "rollout/samples": "samples started", "rollout/trained_tokens": "response tokens trained on",
    "rollout/groups_started": "new prompts rolled out",
    "rollout/rounds": "generation rounds (dynamic sampling; APRIL: segments)",
    "rollout/effective_groups": "complete groups with signal ready to train",
    "rollout/filtered_groups": "zero-variance groups dropped by dynamic sampling",
    "rollout/discarded_tokens": "generated tokens the rollout dropped (by reason: rollout/waste/*)",
    # where the generated tokens went (trainer/rollout/ledger.py): per step,
    # generated = trained + change in waiting + the waste parts
    "rollout/tokens/generated": "rollout tokens generated this step (evaluations excluded)",
    "rollout/tokens/trained": "generated tokens trained on this step",
    "rollout/tokens/waiting": "generated tokens held for a later step (buffer, queue, generating)",
    "rollout/tokens/generated_total": "rollout tokens generated so far",
    "rollout/tokens/trained_total": "generated tokens trained on so far",
    "rollout/waste/version_span": "tokens dropped: APRIL samples older than max_version_span",
    "rollout/waste/stale": "tokens dropped: asynchronous groups staler than eta",
    "rollout/waste/zero_variance": "tokens dropped: zero-variance groups left out",
    "rollout/waste/surplus": "tokens dropped: complete groups no step will take",
    "rollout/waste/aborted": "tokens dropped: samples aborted and not kept",
    "rollout/waste/mismatch": "tokens dropped: masked out by the mismatch correction (mask, band)",
    "rollout/waste/agent_timeout": "tokens dropped: agents' episodes timed out (episode.agent_timeout_s)",
    "rollout/waste/total": "tokens dropped this step, every reason",
    "rollout/waste/share_total": "share of the run's generated tokens dropped so far",
    # agents' episodes over the OpenAI-compatible endpoint (episode.agents, trainer/agents/)
    "agents/calls": "chat completions the endpoint answered this step",
    "agents/open": "agents' episodes open at the step's end (called, not yet rewarded)",
    "agents/rewarded": "agents' episodes rewarded this step",
    "agents/timeouts": "agents' episodes dropped this step: no call nor reward in "
                       "episode.agent_timeout_s",
    "agents/waiting": "rewarded episodes waiting for the rest of their group",
    # multi-turn episodes (trainer/episode/; rollout/base.py episode_metrics): the step's scored
    # episodes, reported by multi-turn runs only
    "episode/turns": "model turns per episode, mean",
    "episode/turns/max": "model turns of the longest episode",
    "episode/tool_calls": "tool calls in the step's scored episodes",
    "episode/tool_errors": "tool calls that failed (bad call, error, timeout): the tool's message",
    "episode/tool_s": "seconds the step's scored episodes spent in tools, summed",
    "episode/tool_use_rate": "share of episodes with at least one tool call",
    "episode/max_turns_ratio": "share of episodes that ran out of turns (episode.max_turns)",
    "episode/env_errors": "episodes your own environment failed (episode.environment: an "
                          "exception or a bad reply, score or state); each scored 0, as an error",
    "episode/env_tokens": "environment tokens (tool results, feedback) in the scored episodes: "
                          "in the context, never trained",
    # the update
    "actor/pg_loss": "policy-gradient loss (token mean)", "actor/kl": "k3 KL to the reference",
    "actor/clip_ratio": "share of tokens clipped", "actor/entropy": "token entropy",
    "actor/importance_weight": "pi_theta / pi_old (pi_prox when asynchronous)",
    "actor/behave_imp_weight": "pi_prox / pi_behaviour (asynchronous)",
    "actor/behave_capped_ratio": "share of tokens over the behaviour-weight cap",
    "actor/grad_norm": "gradient norm before clipping", "actor/lr": "learning rate",
    "actor/loss_tokens": "tokens in the loss", "actor/advantage_abs_mean": "mean |advantage|",
    # training–inference mismatch (trainer/algo/rollout_correction.py): the engine's
    # log-probability pi_rollout (pi_b) against the trainer's pi_old (pi_prox), per trained token
    "mismatch/kl": "engine vs trainer: k3 estimate of KL(pi_rollout || pi_old), token mean",
    "mismatch/kl_k1": "engine vs trainer: k1 estimate (log pi_rollout - log pi_old), token mean",
    "mismatch/abs_logp_diff": "mean |log pi_old - log pi_rollout| per token",
    "mismatch/abs_logp_diff_max": "largest |log pi_old - log pi_rollout| of the step",
    "mismatch/outside_band_ratio": "share of tokens whose pi_old / pi_rollout is outside "
                                   "[mismatch.lower, mismatch.upper]",
    "mismatch/tokens": "tokens measured",
    "mismatch/correction_weight": "mean correction weight applied (1 = no correction)",
    "mismatch/correction_zeroed_ratio": "share of tokens the correction masked out of the loss",
    "mismatch/correction_zeroed_tokens": "tokens the correction masked out of the loss "
                                         "(rollout/waste/mismatch)",
    "mismatch/correction_truncated_ratio": "share of tokens whose weight was truncated at upper",
    # throughput and time
    # what the run's processes held so far (trainer/accounting/cost.py; docs/cost.md): device-hours by
    # kind, and their price at the run's own [cost] rates (only when it sets one)
    "cost/gpu_hours": "GPU-hours held by the run's processes so far",
    "cost/cpu_core_hours": "CPU core-hours held by the run's processes so far (runs without a GPU)",
    "cost/price": "the run's price so far at its own cost.gpu_hour / cost.cpu_core_hour",
    "perf/gen_tokens_per_s": "generated tokens per second of generation",
    "perf/trained_tokens_per_s": "trained tokens per second of step",
    "perf/rollout_trained_tokens_per_s": "trained tokens per second of rollout",
    "perf/weight_sync_bytes": "bytes the update copied to the generators (0: shared in process)",
    "timing/gen_s": "generation (asynchronous: waiting for groups)", "timing/reward_s": "rewards",
    "timing/train_s": "update", "timing/weight_sync_s": "weights to the engine",
    "engine/prefill_tokens": "tokens the engine prefilled (prompts, resumed histories, new turns)",
    "engine/prefill_shared_tokens": "prompt tokens copied from the prompt cache or a running "
    "sibling instead of prefilled (engine.prompt_cache_tokens)",
    "engine/prefill_calls": "forward passes the engine's admissions ran (batches of prefilled rows)",
    "engine/resumed_prefill_tokens": "prefill tokens of samples admitted with a response (a "
    "history prefilled again: no kept KV cache)",
    "engine/kv_kept_tokens": "cached positions resumed samples went on from instead of a prefill",
    "engine/kv_evicted": "parked KV caches given up for a slot (prefilled again if resumed)",
    "engine/parked_kv_tokens": "positions held by parked KV caches at the step's end",
    "engine/parked_kv_mb": "memory of the parked KV caches at the step's end (MB; inside the "
    "engine's cache)",
    "engine/generators_alive": "generation processes in service (cluster.gen_procs)",
    "engine/lost_tokens": "tokens generated by generation processes that died, never delivered "
                          "(cumulative; regenerated elsewhere)",
    "timing/step_s": "whole step", "timing/samples_s": "recording samples (rollout inspector)",
    "train/policy_version": "policy version after the step",
    "train/samples_total": "samples generated so far", "train/gen_tokens_total": "tokens generated",
    "train/trained_tokens_total": "tokens trained on so far",
    # APRIL
    "april/buffer_size": "partial-rollout buffer (groups; at most N')", "april/buffer_samples": "buffer samples",
    "april/buffer_tokens": "buffer tokens", "april/submitted": "samples submitted",
    "april/completed": "samples finished", "april/parked": "samples parked",
    "april/dropped": "samples dropped (version span)", "april/aborted_tokens": "tokens aborted",
    "april/span_dropped_groups": "groups dropped for their version span",
    "april/last_chance_groups": "groups resumed one step before their version span would drop "
                                "them, generated to their end (the step waits for them)",
    "april/segment_max_tokens": "current segment limit",
    "april/top_ups": "times new groups were started mid-step as others completed or were filtered",
    "april/offpolicy_token_ratio": "share of trained tokens from older policies",
    "april/masked_tokens": "off-policy model tokens masked out of the loss",
    # GRESO
    "greso/skip_rate": "share of drawn prompts skipped", "greso/skip_rate/easy": "easy ones",
    "greso/skip_rate/hard": "hard ones", "greso/p_easy": "exploration probability, easy",
    "greso/p_hard": "exploration probability, hard", "greso/prompts_sampled": "prompts drawn",
    "greso/skips_judged": "skips judged this step: their prompt was rolled out again",
    "greso/wrong_skip_ratio": "share of the judged skips whose prompt's next group had signal "
    "(mixed rewards): the skipped rollout would have taught something",
    # asynchronous training
    "async/staleness/mean": "versions behind, mean over trained samples",
    "async/staleness/max": "versions behind, max", "async/max_staleness": "eta",
    "async/queue_size": "complete groups waiting", "async/running_groups": "groups generating",
    "async/dropped_stale_groups": "groups dropped as too stale (cumulative)",
    "async/accepted": "admission counter", "async/admission_bound": "(eta + v + 1) x B",
    "async/trainer_wait_s": "trainer waiting for groups",
    "async/generator_idle_frac": "share of the step the generator was idle",
    "async/trainer_idle_frac": "share of the step the trainer waited",
    # invariants checked from what each step trains (trainer/invariants/rules.py; docs/invariants.md):
    # samples that broke each rule this step, 0 when it held
    "invariants/beyond_eta": "trained samples with a token more than eta versions old (async)",
    "invariants/beyond_span": "trained samples with a token older than the version span (APRIL; 0 without)",
    "invariants/trained_twice": "samples trained again (a sample, group or episode trained before)",
    "invariants/env_loss": "samples whose environment tokens carried loss",
    "invariants/prompts_skipped": "data-cursor positions drawn and lost (never scored, skipped or "
    "dropped on purpose, no longer held): prompts of the epoch skipped",
    "invariants/prompts_repeated": "data-cursor positions handed out again (the cursor moved back)",
    "invariants/prompts_greso_skipped": "prompts GRESO skipped on purpose (not a breach)",
    "invariants/prompts_dropped": "unfinished groups' prompts a driver dropped on purpose (APRIL's "
    "surplus beyond a lowered N'; not a breach)",
    "invariants/bound": "the token-age bound in force this step (eta, or the version span)",
    "timing/invariants_s": "seconds the step's invariant checks took",
    # the weight probe after each sync (trainer/invariants/probe.py)
    "invariants/weights_not_applied": "generators whose probe log-probabilities left the band: "
    "they sample with weights other than those just sent",
    "invariants/probe_dlogp": "the probe's mean |delta log p|, engine vs trainer (the worst generator)",
    "invariants/probe_max_dlogp": "the probe's largest single-token |delta log p| (the worst generator)",
    "invariants/probe_band": "the band the probe's mean |delta log p| must stay in (set by precision)",
    "invariants/probe_adapter_dlogp": "LoRA: the probe's mean |delta log p|, policy vs the base "
    "(adapters off)",
    "invariants/probe_adapters_shown": "LoRA: 1 when the probe shows the engines apply the adapters",
    "timing/probe_s": "seconds the weight probe took",
    # the machine
    "system/cpu_util": "CPU utilisation (% of all cores)", "system/ram_gb": "trainer RSS (GB)",
    "system/gpu_util": "GPU utilisation (%), mean over devices",
    "system/gpu_mem_gb": "GPU memory (GB), mean", "system/gpu_power_w": "GPU power (W), mean",
    "system/cuda_peak_mem_gb": "peak CUDA memory this step (GB)",
    "dist/world_size": "training processes (rank 0 the controller, every rank trains a share)",
    "dist/train_share_imbalance": "the largest training share over the mean share, in tokens (1 = even)",
}
# per device i: system/gpu{i}/util, system/gpu{i}/mem_gb, system/gpu{i}/power_w; per process
# of the run, named by its timeline lane (rank0, rank1, engine, ...: trainer/observe/timeline.py):
# proc/<lane>/cpu_pct (% of one core) and proc/<lane>/rss_gb (trainer/observe/system.py ProcessMeter)
PATTERNS = {r"^system/gpu\d+/(util|mem_gb|power_w)$": "per-GPU telemetry",
            r"^proc/[A-Za-z0-9_-]+/(cpu_pct|rss_gb)$": "per-process CPU (% of one core) and memory (GB)",
            # by policy-version age (APRIL, asynchronous): age 0 is the engine's mismatch alone,
            # older tokens add the policy's drift since they were sampled
            r"^mismatch/age(0|1|2plus)/(kl|abs_logp_diff|abs_logp_diff_max)$":
                "mismatch by token age (versions): k3 KL, mean and largest |log pi_old - log pi_rollout|"}

HISTOGRAM_AXES: dict[str, str] = {  # histogram name -> what its x axis counts
    "rollout/response_len": "response length (tokens the model wrote)",
    "async/staleness": "staleness (policy versions behind)",
    "april/version_span": "versions spanned by one sample (policy versions)",
    "april/buffer_age": "age of a buffered partial sample (policy versions)",
    "mismatch/seq_log_ratio": "log pi_old(y) - log pi_rollout(y) per sequence",
}

# The dashboard's charts, in page order. keys: line traces; "fallback": used when the first
# key has no data (no GPU); "pattern": traces for every matching name (one per device);
# "prefix": every name under it; type "hist"/"heat": the histogram `name`; "eta": draw eta;
# "band": draw the mismatch band's |log| ends (mismatch.lower, mismatch.upper) on the y2 axis;
# "y2": 1 draws the second key on a right axis, "y2": [names] those keys; "split": the y2 keys on
# a panel of their own below the others (two scales that never share a pixel row: a value's
# height on one says nothing about the other's); "axes": the [left/top, right/bottom] axis titles.
CHARTS: list[dict] = [
    {"id": "system", "title": "GPU utilisation (%) and memory (GB), mean over devices",
     "keys": ["system/gpu_util", "system/gpu_mem_gb"], "y2": 1,
     "fallback": {"title": "CPU utilisation (%) and RAM (GB) — no GPU",
                  "keys": ["system/cpu_util", "system/ram_gb"]}},
    {"id": "gpu-util", "title": "GPU utilisation per device (%)", "pattern": r"^system/gpu\d+/util$"},
    {"id": "gpu-mem", "title": "GPU memory per device (GB)", "pattern": r"^system/gpu\d+/mem_gb$"},
    {"id": "gpu-power", "title": "GPU power (W): mean and per device",
     "keys": ["system/gpu_power_w"], "pattern": r"^system/gpu\d+/power_w$"},
    {"id": "proc-cpu", "title": "CPU per process (% of one core)", "pattern": r"^proc/[^/]+/cpu_pct$"},
    {"id": "proc-mem", "title": "Memory per process (RSS, GB)", "pattern": r"^proc/[^/]+/rss_gb$"},
    {"id": "reward", "title": "Reward and accuracy",
     "keys": ["reward/mean", "reward/accuracy", "eval/accuracy"]},
    {"id": "kl", "title": "KL to the reference (k3)", "keys": ["actor/kl"]},
    {"id": "episodes", "title": "Episodes: model turns (top), shares of episodes (bottom)",
     "split": True, "axes": ["model turns", "share of episodes"],
     "keys": ["episode/turns", "episode/turns/max", "eval/turns_mean", "episode/tool_use_rate",
              "episode/max_turns_ratio", "eval/tool_use_rate"],
     "y2": ["episode/tool_use_rate", "episode/max_turns_ratio", "eval/tool_use_rate"]},
    {"id": "tools", "title": "Tool calls and tool errors per step",
     "keys": ["episode/tool_calls", "episode/tool_errors"]},
    {"id": "agents", "title": "Agents: calls answered, episodes rewarded, timed out, open",
     "keys": ["agents/calls", "agents/rewarded", "agents/timeouts", "agents/open",
              "agents/waiting"]},
    {"id": "tool-time", "title": "Tool seconds per step, and environment tokens (right axis)",
     "keys": ["episode/tool_s", "episode/env_tokens"], "y2": 1},
    # the engine's own disagreement: tokens the current policy sampled (age 0); a run that mixes
    # versions (APRIL, asynchronous) splits by age, and its older tokens' share is staleness
    {"id": "mismatch", "title": "Engine vs trainer: the engine's own (age-0 tokens)",
     "keys": ["mismatch/age0/kl", "mismatch/age0/abs_logp_diff_max"], "y2": 1, "split": True,
     "band": True, "axes": ["KL (k3)", "max |Δ log p|"],
     "fallback": {"title": "Engine vs trainer (every token the current policy's)",
                  "keys": ["mismatch/kl", "mismatch/abs_logp_diff_max"]}},
    # older tokens' KL is the policy's drift since they were sampled: staleness, beside age 0
    {"id": "mismatch-age", "title": "Staleness: KL (k3) of older tokens (age 1, 2+) vs age 0",
     "pattern": r"^mismatch/age[^/]+/kl$"},
    {"id": "mismatch-correction",
     "title": "Engine vs trainer: tokens outside the band, and the correction",
     "keys": ["mismatch/outside_band_ratio", "mismatch/correction_weight",
              "mismatch/correction_zeroed_ratio", "mismatch/correction_truncated_ratio"]},
    {"id": "mismatch-hist", "type": "hist", "name": "mismatch/seq_log_ratio",
     "title": "Engine vs trainer: log-ratio per sequence (latest step)"},
    {"id": "len-hist", "type": "hist", "name": "rollout/response_len",
     "title": "Rollout length (latest step)"},
    {"id": "len-heat", "type": "heat", "name": "rollout/response_len",
     "title": "Rollout length: steps × length bins (log colour)"},
    {"id": "resp-len", "title": "Response length (tokens)",
     "keys": ["rollout/response_len/mean", "rollout/response_len/p50",
              "rollout/response_len/p90", "rollout/response_len/max"]},
    {"id": "staleness", "title": "Staleness: mean and max against η",
     "keys": ["async/staleness/mean", "async/staleness/max"], "eta": True},
    {"id": "staleness-hist", "type": "hist", "name": "async/staleness",
     "title": "Staleness histogram (latest step)"},
    {"id": "throughput", "title": "Throughput (tokens/s): generated and trained",
     "keys": ["perf/gen_tokens_per_s", "perf/trained_tokens_per_s"]},
    {"id": "tokens", "title": "Where the generated tokens went (per step)",
     "keys": ["rollout/tokens/generated", "rollout/tokens/trained", "rollout/tokens/waiting",
              "rollout/waste/version_span", "rollout/waste/stale", "rollout/waste/zero_variance",
              "rollout/waste/surplus", "rollout/waste/aborted", "rollout/waste/mismatch",
              "rollout/waste/agent_timeout"]},
    {"id": "zero-var", "title": "Zero-variance group ratio",
     "keys": ["rollout/zero_var_ratio", "rollout/zero_var_ratio/all_correct",
              "rollout/zero_var_ratio/all_wrong"]},
    {"id": "greso", "title": "GRESO: skip rate, p_easy, p_hard",
     "keys": ["greso/skip_rate", "greso/p_easy", "greso/p_hard"]},
    {"id": "april", "title": "APRIL: buffer size and off-policy token ratio",
     "keys": ["april/buffer_size", "april/offpolicy_token_ratio"], "y2": 1},
    {"id": "hist-april-version-span", "type": "hist", "name": "april/version_span",
     "title": "APRIL: version span per sample (latest step)"},
    {"id": "hist-april-buffer-age", "type": "hist", "name": "april/buffer_age",
     "title": "APRIL: age of buffered samples (latest step)"},
    {"id": "kv-kept", "title": "KV cache: prefilled, kept across a park, parked at the end (tokens)",
     "keys": ["engine/prefill_tokens", "engine/resumed_prefill_tokens", "engine/kv_kept_tokens",
              "engine/parked_kv_tokens"]},
    {"id": "timing", "title": "Step timings (s)", "prefix": "timing/"},
    {"id": "actor", "title": "Clip ratio, importance weight, grad norm",
     "keys": ["actor/clip_ratio", "actor/importance_weight", "actor/behave_imp_weight",
              "actor/grad_norm"]},
]


def declared(name: str) -> bool:
    return name in SCALARS or any(re.match(p, name) for p in PATTERNS)


def page_spec() -> dict:
    """What the pages' chart code needs (JSON)."""
    return {"charts": CHARTS, "histogram_axes": HISTOGRAM_AXES}
