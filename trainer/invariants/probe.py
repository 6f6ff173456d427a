"""Whether the engine samples with the weights just sent: a probe after each weight sync.

A fixed short token sequence x (`probe_tokens`: the tokenizer's own encoding of PROBE_TEXT, at
most PROBE_TOKENS tokens) is scored by every generator of the engine (`probe_logprobs`: the
embedded engine, each generation process, each SGLang server) and by the trainer, all at
temperature 1:

    l_e[t] = log p_engine(x_t | x_<t),   l_pi[t] = log pi_theta(x_t | x_<t),   t = 1..n-1
    d_e    = mean_t |l_e[t] - l_pi[t]|      (and its max over t, reported beside it)

A generator breaks `weights_not_applied` when d_e > band: it samples with weights other than the
policy just sent (an update that silently failed, a sync that reached some generators only). The
mean, not the max, decides: rounding noise is independent from token to token and averages down,
while other weights shift every token. The band is the precision's (`band`: the coarser of the
engine's and the trainer's dtypes), set well above what two correct passes of the same weights
differ by (measured: docs/invariants.md).

With LoRA the trainer also scores x with its adapters off (the base, l_0), and

    g = mean_t |l_pi[t] - l_0[t]|

says how far the adapters moved the probe. Once g > band the probe can tell the two apart: a
generator that received the base but not the adapters is about g from l_pi, beyond the band,
and closer to l_0; its violation says so. While g <= band (the first steps, adapters start at
B = 0; under bfloat16 for long, its rounding hides small adapters) no claim about the adapters
is made: `Probe.adapters_shown` is False.

Pure: token lists and log-probability lists in, a `Probe` out (trainer/run/invariant_watch.py
runs the engines and the trainer).
"""
from __future__ import annotations

from dataclasses import dataclass, field

RULE = "weights_not_applied"
PROBE_TEXT = ("[3,1,4,1,5,9,2,6]=31. The sum of the numbers in the list is 31, so the answer "
              "is 31.")
PROBE_TOKENS = 32   # most tokens scored: one short forward pass per generator and sync

# mean_t |delta log p| above which a generator is on other weights, per precision (the coarser
# of engine and trainer). Measured on the probe (docs/invariants.md, CPU, built-in model): two
# passes of the same weights float32 0 (LoRA merged into the engine: ~2e-6), a generator one
# update behind 2e-3 (LoRA, rank 4) to 0.05; bfloat16 rounding alone 0.02-0.04. float16 (3 more
# mantissa bits than bfloat16) takes bfloat16's band, unmeasured.
BANDS = {"float32": 5e-4, "float64": 5e-4, "float16": 0.1, "bfloat16": 0.1}
_FINENESS = ("float64", "float32", "float16", "bfloat16")


def probe_tokens(tokenizer, n: int = PROBE_TOKENS) -> list[int]:
    """The probe sequence: PROBE_TEXT's token ids (no special tokens), at most `n` of them."""
    ids = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])[:n]
    if len(ids) < 2:
        raise ValueError(f"the probe text encodes to {len(ids)} token(s); it needs at least 2")
    return ids


def band(engine_dtype: str, trainer_dtype: str) -> float:
    """The band for an engine in `engine_dtype` and a trainer in `trainer_dtype` ("float32",
    "bfloat16", "torch.float16", ...): the coarser precision's."""
    names = [str(d).removeprefix("torch.") for d in (engine_dtype, trainer_dtype)]
    for name in names:
        if name not in BANDS:
            raise ValueError(f"no probe band for dtype {name!r}; known: {', '.join(BANDS)}")
    coarsest = max(names, key=_FINENESS.index)
    return BANDS[coarsest]


def abs_diffs(a: list[float], b: list[float]) -> list[float]:
    """|a[t] - b[t]| per token (the two must score the same tokens)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"log-probabilities of {len(a)} and {len(b)} tokens cannot be compared")
    return [abs(x - y) for x, y in zip(a, b)]


def mean_abs_diff(a: list[float], b: list[float]) -> float:
    """mean_t |a[t] - b[t]|."""
    d = abs_diffs(a, b)
    return sum(d) / len(d)


@dataclass
class Probe:
    band: float
    dlogp: dict[str, float] = field(default_factory=dict)       # generator -> d_e (the mean)
    dlogp_max: dict[str, float] = field(default_factory=dict)   # generator -> max_t |delta|
    broken: list[str] = field(default_factory=list)             # generators beyond the band
    base_like: list[str] = field(default_factory=list)          # ... closer to the base (LoRA)
    adapter_gap: float | None = None                            # g; None without LoRA

    @property
    def adapters_shown(self) -> bool:
        """LoRA: the adapters moved the probe past the band, and every generator is within it:
        the probe shows the adapters applied."""
        return self.adapter_gap is not None and self.adapter_gap > self.band and not self.broken

    def detail(self) -> str:
        parts = []
        for name in self.broken:
            why = (" (closer to the base, adapters off, than to the adapted policy: LoRA's "
                   "adapters did not reach it)" if name in self.base_like else "")
            parts.append(f"{name}: mean |delta log p| {self.dlogp[name]:.3g} > band "
                         f"{self.band:g}{why}")
        return ("the engine does not sample with the weights just sent: " + "; ".join(parts)
                if parts else "")

    def figures(self) -> dict[str, float]:
        """invariants/weights_not_applied (generators beyond the band, 0 when healthy),
        invariants/probe_dlogp (the largest d_e), invariants/probe_max_dlogp (the largest
        single token's), invariants/probe_band and, with LoRA, invariants/probe_adapter_dlogp
        (g) and invariants/probe_adapters_shown (1: the probe shows the adapters applied)."""
        m = {f"invariants/{RULE}": float(len(self.broken)),
             "invariants/probe_dlogp": max(self.dlogp.values(), default=0.0),
             "invariants/probe_max_dlogp": max(self.dlogp_max.values(), default=0.0),
             "invariants/probe_band": self.band}
        if self.adapter_gap is not None:
            m["invariants/probe_adapter_dlogp"] = self.adapter_gap
            m["invariants/probe_adapters_shown"] = float(self.adapters_shown)
        return m


def judge(engines: dict[str, list[float]], trainer: list[float], band: float,
          base: list[float] | None = None) -> Probe:
    """Each generator's log-probabilities against the trainer's (`base`: the trainer's with
    LoRA's adapters off, None without LoRA)."""
    if band <= 0:
        raise ValueError(f"the probe band must be > 0; got {band}")
    out = Probe(band)
    if base is not None:
        out.adapter_gap = mean_abs_diff(trainer, base)
    for name, lp in engines.items():
        diffs = abs_diffs(lp, trainer)
        d = out.dlogp[name] = sum(diffs) / len(diffs)
        out.dlogp_max[name] = max(diffs)
        if d > band:
            out.broken.append(name)
            if base is not None and mean_abs_diff(lp, base) < d:
                out.base_like.append(name)
    return out
