"""Whether the engine samples with the weights just sent: a probe after each weight sync.

A fixed short token sequence x (`probe_tokens`: the tokenizer's own encoding of PROBE_TEXT, at
most PROBE_TOKENS tokens) is scored by every generator of the engine (`probe_logprobs`: the
embedded engine, each generation process, each SGLang server) and by the trainer, all at
temperature 1:

    l_e[t] = log p_engine(x_t | x_<t),   l_pi[t] = log pi_theta(x_t | x_<t),   t = 1..n-1
    d_e    = max_t |l_e[t] - l_pi[t]|

A generator breaks `weights_not_applied` when d_e > band: it samples with weights other than the
policy just sent (an update that silently failed, a sync that reached some generators only). The
band is the precision's (`band`: the coarser of the engine's and the trainer's dtypes): two
correct forward passes of the same weights differ by rounding alone, far below it.

With LoRA the trainer also scores x with its adapters off (the base, l_0), and

    g = max_t |l_pi[t] - l_0[t]|

says how far the adapters moved the probe. Once g > band the probe can tell the two apart: a
generator that received the base but not the adapters is within the band of l_0, beyond it of
l_pi, and its violation says so. While g <= band (the first steps; adapters start at B = 0) no
claim about the adapters is made: `Probe.adapters_shown` is False.

Pure: token lists and log-probability lists in, a `Probe` out (trainer/run/invariant_watch.py
runs the engines and the trainer).
"""
from __future__ import annotations

from dataclasses import dataclass, field

RULE = "weights_not_applied"
PROBE_TEXT = ("[3,1,4,1,5,9,2,6]=31. The sum of the numbers in the list is 31, so the answer "
              "is 31.")
PROBE_TOKENS = 32   # most tokens scored: one short forward pass per generator and sync

# max |delta log p| two correct passes of the same weights may differ by, per precision (the
# coarser of engine and trainer). Measured on the probe, as docs/invariants.md reports:
# float32 ~1e-6 (CPU, built-in model) -> 1e-3 leaves three orders of magnitude; bfloat16 and
# float16 round every activation to 8 (11) mantissa bits, a max over the probe's tokens up to
# ~0.1 on the built-in model and SmolLM2 -> 0.5.
BANDS = {"float32": 1e-3, "float64": 1e-3, "float16": 0.5, "bfloat16": 0.5}
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


def max_abs_diff(a: list[float], b: list[float]) -> float:
    """max_t |a[t] - b[t]| (the two must score the same tokens)."""
    if len(a) != len(b):
        raise ValueError(f"log-probabilities of {len(a)} and {len(b)} tokens cannot be compared")
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


@dataclass
class Probe:
    band: float
    dlogp: dict[str, float] = field(default_factory=dict)       # generator -> d_e
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
            why = (" (within the band of the base, adapters off: LoRA's adapters did not reach "
                   "it)" if name in self.base_like else "")
            parts.append(f"{name}: max |delta log p| {self.dlogp[name]:.3g} > band {self.band:g}{why}")
        return ("the engine does not sample with the weights just sent: " + "; ".join(parts)
                if parts else "")

    def figures(self) -> dict[str, float]:
        """invariants/weights_not_applied (generators beyond the band, 0 when healthy),
        invariants/probe_max_dlogp, invariants/probe_band and, with LoRA,
        invariants/probe_adapter_dlogp (g)."""
        m = {f"invariants/{RULE}": float(len(self.broken)),
             "invariants/probe_max_dlogp": max(self.dlogp.values(), default=0.0),
             "invariants/probe_band": self.band}
        if self.adapter_gap is not None:
            m["invariants/probe_adapter_dlogp"] = self.adapter_gap
        return m


def judge(engines: dict[str, list[float]], trainer: list[float], band: float,
          base: list[float] | None = None) -> Probe:
    """Each generator's log-probabilities against the trainer's (`base`: the trainer's with
    LoRA's adapters off, None without LoRA)."""
    if band <= 0:
        raise ValueError(f"the probe band must be > 0; got {band}")
    out = Probe(band)
    if base is not None:
        out.adapter_gap = max_abs_diff(trainer, base)
    for name, lp in engines.items():
        d = max_abs_diff(lp, trainer)
        out.dlogp[name] = d
        if d > band:
            out.broken.append(name)
            if base is not None and max_abs_diff(lp, base) < d:
                out.base_like.append(name)
    return out
