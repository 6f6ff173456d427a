"""The rollout inspector's rows on the web side (the `RolloutSample` table): what the trainer's
sink hands over, cleaned for the database; the per-run cap (oldest steps thinned first); the
filters, orders and cursors of GET /api/runs/<id>/samples; the compact summary the WebSocket sends.

The actions layer calls `row_for` and `thin` inside its transaction; the API, the streams and
the reports read through the rest. This module imports only the models, access/validation.py and
errors.py (never the actions layer).
"""
from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

from django.conf import settings
from django.db.models import F, Q

from webapp.dashboard.access import validation
from webapp.dashboard.errors import Invalid
from webapp.dashboard.models import RolloutSample

FINISH = RolloutSample.FINISH
REWARD_STATUS = RolloutSample.REWARD_STATUS
WHY = RolloutSample.WHY

MAX_TEXT = 200_000          # characters kept of a prompt or a completion
MAX_ERROR = 5_000           # of a reward error
MAX_TOKENS = 65_536         # token pieces (and log-probabilities) kept per sample
MAX_PIECE = 200             # characters of one token piece
MAX_SEGMENTS = 4_096
MAX_Q = 200                 # characters of a text search
DEFAULT_LIMIT, MAX_LIMIT = 50, 500
MAX_INT = 2 ** 31 - 1       # step, length, staleness columns are 32-bit integers
MAX_GROUP = 2 ** 63 - 1

# what a WebSocket frame carries per sample (the page fetches the rest when one is opened)
SUMMARY_FIELDS = ("id", "step", "group", "index", "length", "reward", "finish", "why",
                  "reward_status", "staleness")
# the list without tokens and log-probabilities (fields=summary): the table's rows
LIST_FIELDS = SUMMARY_FIELDS + ("score", "penalty", "advantage", "tis_weight", "seq", "episode")
FULL_FIELDS = LIST_FIELDS + ("prompt", "completion", "segments", "reward_error", "tokens", "logprobs",
                             "turns")
PREVIEW = 160               # characters of the completion in a summary list


# --- cleaning what the trainer hands over ---------------------------------------------------------

def _float(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _int(v: Any, lo: int = 0, hi: int = MAX_INT) -> int:
    try:
        i = int(v)
    except (TypeError, ValueError, OverflowError):
        return 0
    return max(lo, min(hi, i))


def _text(v: Any, limit: int) -> str:
    """Text the database can hold: NUL and lone surrogates replaced (config.UNSTORABLE, as
    validation.clip does for every text), at most `limit` characters."""
    return validation.clip("" if v is None else v, limit)


def _choice(v: Any, allowed: tuple[str, ...], default: str) -> str:
    return v if isinstance(v, str) and v in allowed else default


def _segments(v: Any) -> list[list[int]]:
    out = []
    for seg in (v if isinstance(v, (list, tuple)) else [])[:MAX_SEGMENTS]:
        if isinstance(seg, (list, tuple)) and len(seg) == 2:
            out.append([_int(seg[0], -MAX_INT), _int(seg[1])])
    return out


MAX_TURNS = 4_096           # turns kept per episode (the trainer allows 64 model turns)
TURN_ROLES = ("model", "tool")
# why an episode ended (meta["episode"]["end"], trainer/episode/engine.py), as the pages say it
EPISODE_END_TEXT = {"answer": "answered", "max_turns": "out of turns (episode.max_turns)",
                    "budget": "out of tokens (max_response_len)"}
EPISODE_ENDS = (*EPISODE_END_TEXT, "")


def _turns(v: Any, length: int) -> list[dict[str, Any]]:
    """An episode's turns: {"role", "start", "end", "trained"}, positions within the response."""
    out = []
    for t in (v if isinstance(v, (list, tuple)) else [])[:MAX_TURNS]:
        if not isinstance(t, dict) or t.get("role") not in TURN_ROLES:
            continue
        start = _int(t.get("start"), 0, length)
        end = _int(t.get("end"), start, length)
        out.append({"role": t["role"], "start": start, "end": end,
                    "trained": t.get("trained") is True and t["role"] == "model"})
    return out


def _episode(v: Any) -> dict[str, Any]:
    """An episode's counters (empty for a single-turn sample)."""
    if not isinstance(v, dict):
        return {}
    seconds = _float(v.get("tool_s"))
    return {"turns": _int(v.get("turns")), "tool_calls": _int(v.get("tool_calls")),
            "tool_errors": _int(v.get("tool_errors")),
            "tool_s": max(0.0, seconds) if seconds is not None else 0.0,
            "end": _choice(v.get("end"), EPISODE_ENDS, "")}


def row_for(run_id: int, seq: int, step: int, row: Any) -> RolloutSample | None:
    """One sample row as the trainer's sink gives it (MetricsSink.samples) -> a model instance
    (unsaved), or None when it is not a dict. The step is the sink call's (the training step).
    Missing or ill-typed values get defaults; text is made storable; non-finite numbers become
    NULL."""
    if not isinstance(row, dict):
        return None
    tokens = row.get("tokens")
    logprobs = row.get("logprobs")
    tokens = [_text(t, MAX_PIECE) for t in tokens[:MAX_TOKENS]] if isinstance(tokens, (list, tuple)) else []
    logprobs = [_float(x) for x in logprobs[:MAX_TOKENS]] if isinstance(logprobs, (list, tuple)) else []
    reward, score = _float(row.get("reward")), _float(row.get("score"))
    penalty = _float(row.get("penalty"))
    status = _choice(row.get("reward_status"), REWARD_STATUS, "ok")
    return RolloutSample(
        run_id=run_id, seq=seq, step=_int(step), group=_int(row.get("group"), 0, MAX_GROUP),
        index=_int(row.get("index")), prompt=_text(row.get("prompt"), MAX_TEXT),
        completion=_text(row.get("completion"), MAX_TEXT), reward=reward, score=score,
        penalty=penalty if penalty is not None else 0.0, advantage=_float(row.get("advantage")),
        length=_int(row.get("length", len(tokens))), finish=_choice(row.get("finish"), FINISH, "stop"),
        segments=_segments(row.get("segments")), staleness=_int(row.get("staleness")),
        tis_weight=_float(row.get("tis_weight")), reward_status=status,
        reward_error=_text(row.get("reward_error") or "", MAX_ERROR),
        why=_choice(row.get("why"), WHY, "group"), tokens=tokens, logprobs=logprobs,
        turns=_turns(row.get("turns"), _int(row.get("length", len(tokens)))),
        episode=_episode(row.get("episode")))


# --- the per-run cap -------------------------------------------------------------------------------

def _level(step: int) -> int:
    """How long a step's samples survive thinning: the power of two dividing the step number
    (steps 8, 16, 24 outlive steps 2, 6, 10, which outlive the odd ones)."""
    return 64 if step == 0 else (abs(step) & -abs(step)).bit_length() - 1


def thin(run_id: int, cap: int | None = None) -> int:
    """Keep at most `cap` samples for the run (RLPILOT_SAMPLES_PER_RUN; 0 = no cap). While over
    it, among the oldest half of the run's steps, the samples of the steps of the lowest level
    go (the odd steps first, then those not divisible by 4, ...: every other step of what is
    left), whole steps at a time. A long run so keeps a spread over its whole history, sparser
    the older it is, and its newest steps whole; a step that survived a pass keeps surviving as
    new steps arrive. A single step over the cap keeps its last `cap` samples. Called by the
    actions layer inside the transaction that wrote the samples. Returns rows deleted."""
    cap = settings.SAMPLES_PER_RUN if cap is None else cap
    if cap <= 0:
        return 0
    qs = RolloutSample.objects.filter(run_id=run_id)
    total = qs.count()
    deleted = 0
    while total > cap:
        steps = list(qs.values_list("step", flat=True).distinct().order_by("step"))
        if len(steps) == 1:
            extra = list(qs.order_by("-id").values_list("id", flat=True)[cap:])
            RolloutSample.objects.filter(id__in=extra).delete()
            deleted += len(extra)
            break
        older = steps[:max(1, len(steps) // 2)]
        lowest = min(_level(s) for s in older)
        n = qs.filter(step__in=[s for s in older if _level(s) == lowest]).delete()[0]
        deleted += n
        total -= n
    return deleted


# --- reading -----------------------------------------------------------------------------------------

def _num(v: float | None) -> float | None:
    return v if v is None or math.isfinite(v) else None


def as_json(s: RolloutSample | dict, fields: tuple[str, ...] = FULL_FIELDS, words: bool = True) -> dict[str, Any]:
    """A sample's `fields` as the API serves them; `words`: an episode's end in words too
    ("end_text", for the pages; the exports carry the stored row)."""
    get = s.get if isinstance(s, dict) else (lambda k: getattr(s, k))
    out = {k: get(k) for k in fields}
    for k in ("reward", "score", "penalty", "advantage", "tis_weight"):
        if k in out:
            out[k] = _num(out[k])
    ep = out.get("episode")
    if words and isinstance(ep, dict) and ep.get("end"):   # the end in words, the inspector's
        out["episode"] = {**ep, "end_text": EPISODE_END_TEXT.get(ep["end"], ep["end"])}
    return out


def summary_rows(run_id: int, seq_lo: int, seq_hi: int) -> dict[int, list[dict[str, Any]]]:
    """{seq: [summary, ...]} for the samples with seq in (seq_lo, seq_hi] (WebSocket frames)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for row in (RolloutSample.objects.filter(run_id=run_id, seq__gt=seq_lo, seq__lte=seq_hi)
                .order_by("seq", "id").values("seq", *SUMMARY_FIELDS)):
        out.setdefault(row.pop("seq"), []).append(as_json(row, SUMMARY_FIELDS))
    return out


# orders: the columns compared, (name, descending, nullable); the row id breaks ties
ORDERS = {
    "step": [("step", False, False), ("group", False, False), ("index", False, False)],
    "-step": [("step", True, False), ("group", False, False), ("index", False, False)],
    "length": [("length", False, False)],
    "-length": [("length", True, False)],
    "reward": [("reward", False, True)],
    "-reward": [("reward", True, True)],
}


def _order_by(order: str) -> list:
    out = []
    for name, desc, nullable in ORDERS[order]:
        f = F(name)
        out.append(f.desc(nulls_last=True) if desc else f.asc(nulls_last=True) if nullable else f.asc())
    out.append(F("id").asc())
    return out


def encode_cursor(order: str, s: dict[str, Any]) -> str:
    key = [order] + [s[name] for name, _, _ in ORDERS[order]] + [s["id"]]
    raw = json.dumps(key, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(text: str, order: str) -> list:
    """The key values a cursor holds (raises Invalid naming `after`)."""
    bad = Invalid("bad query", {"after": "expected a cursor from a previous reply of this endpoint, "
                                         "with the same order"})
    if len(text) > 400:
        raise bad
    try:
        key = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    except (ValueError, binascii.Error, UnicodeDecodeError, RecursionError):
        raise bad from None
    cols = ORDERS[order]
    if not isinstance(key, list) or len(key) != len(cols) + 2 or key[0] != order:
        raise bad
    values = key[1:]
    for (name, _, nullable), v in zip(cols + [("id", False, False)], values):
        if v is None and nullable:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise bad
        if name != "reward" and (not isinstance(v, int) or abs(v) > (MAX_GROUP if name in ("group", "id")
                                                                      else MAX_INT)):
            raise bad
    return values


def _after(order: str, values: list) -> Q:
    """Rows strictly after the key `values` in `order` (lexicographic; NULLs last)."""
    cols = ORDERS[order] + [("id", False, False)]
    result = Q(pk__in=[])
    equal = Q()
    for (name, desc, nullable), v in zip(cols, values):
        if v is None:   # in the NULL tail of this column: nothing sorts after it here
            strict = Q(pk__in=[])
            eq = Q(**{f"{name}__isnull": True})
        else:
            strict = Q(**{f"{name}__{'lt' if desc else 'gt'}": v})
            if nullable:
                strict |= Q(**{f"{name}__isnull": True})
            eq = Q(**{name: v})
        result |= equal & strict
        equal &= eq
    return result


def _int_param(params, name: str, errors: dict, lo: int = 0, hi: int = MAX_INT) -> int | None:
    raw = params.get(name)
    if raw in (None, ""):
        return None
    try:
        v = int(raw)
        if not lo <= v <= hi:
            raise ValueError
    except (ValueError, OverflowError):
        errors[name] = f"expected an integer in [{lo}, {hi}]"
        return None
    return v


def _float_param(params, name: str, errors: dict) -> float | None:
    raw = params.get(name)
    if raw in (None, ""):
        return None
    try:
        v = float(raw)
        if not math.isfinite(v):
            raise ValueError
    except (ValueError, OverflowError):
        errors[name] = "expected a finite number"
        return None
    return v


FILTERS = ("step", "min_step", "max_step", "min_reward", "max_reward", "min_len", "max_len", "finish",
           "reward_status", "q", "group", "order", "after", "limit", "fields")


def query(run_id: int, params) -> dict[str, Any]:
    """GET /api/runs/<id>/samples: {"samples": [...], "cursor": str | None}. Raises Invalid with
    one message per bad parameter."""
    errors: dict[str, str] = {}
    qs = RolloutSample.objects.filter(run_id=run_id)
    for name, lookup in (("step", "step"), ("min_step", "step__gte"), ("max_step", "step__lte"),
                         ("min_len", "length__gte"), ("max_len", "length__lte")):
        v = _int_param(params, name, errors)
        if v is not None:
            qs = qs.filter(**{lookup: v})
    group = _int_param(params, "group", errors, 0, MAX_GROUP)
    if group is not None:
        qs = qs.filter(group=group)
    for name, lookup in (("min_reward", "reward__gte"), ("max_reward", "reward__lte")):
        v = _float_param(params, name, errors)
        if v is not None:
            qs = qs.filter(**{lookup: v})
    for name, allowed in (("finish", FINISH), ("reward_status", REWARD_STATUS)):
        v = params.get(name)
        if v not in (None, ""):
            if v not in allowed:
                errors[name] = "one of " + ", ".join(allowed)
            else:
                qs = qs.filter(**{name: v})
    q = params.get("q")
    if q not in (None, ""):
        problem = validation.text_error(q, MAX_Q)
        if problem:
            errors["q"] = problem
        else:
            qs = qs.filter(Q(prompt__icontains=q) | Q(completion__icontains=q))
    order = params.get("order") or "step"
    if order not in ORDERS:
        errors["order"] = "one of " + ", ".join(ORDERS)
        order = "step"
    limit = _int_param(params, "limit", errors, 1, MAX_LIMIT)
    limit = DEFAULT_LIMIT if limit is None else limit
    fields = params.get("fields") or "full"
    if fields not in ("full", "summary"):
        errors["fields"] = "one of full, summary"
    after = params.get("after")
    if after not in (None, "") and "order" not in errors:
        try:
            qs = qs.filter(_after(order, decode_cursor(after, order)))
        except Invalid as e:
            errors.update(e.errors)
    unknown = sorted(set(params) - set(FILTERS))
    for name in unknown[:5]:
        errors[name] = "unknown parameter; expected " + ", ".join(FILTERS)
    if errors:
        raise Invalid("bad query", errors)
    names = FULL_FIELDS if fields == "full" else LIST_FIELDS + ("completion",)
    rows = list(qs.order_by(*_order_by(order)).values(*names)[:limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    out = [as_json(r, names) for r in rows]
    if fields == "summary":
        for r in out:
            text = r.pop("completion") or ""
            r["preview"] = text if len(text) <= PREVIEW else text[:PREVIEW] + "…"
    return {"samples": out, "cursor": encode_cursor(order, rows[-1]) if more and rows else None}


def detail(run_id: int, sample_id: int) -> dict[str, Any] | None:
    """GET /api/runs/<id>/samples/<sample_id>: the sample whole, and the other members of its
    group at that step (by index; a member recorded twice, e.g. as a group member and as the
    step's longest, once)."""
    s = RolloutSample.objects.filter(run_id=run_id, pk=sample_id).first()
    if s is None:
        return None
    members, seen = [], {s.index}
    for m in (RolloutSample.objects.filter(run_id=run_id, step=s.step, group=s.group)
              .exclude(pk=s.pk).order_by("index", "id")):
        if m.index not in seen:
            seen.add(m.index)
            members.append(as_json(m))
    return {"sample": as_json(s), "group": members}


def export_rows(run_id: int, per_token: bool = True):
    """Every sample of the run in write order: whole, or without its per-token arrays (tokens,
    log-probabilities)."""
    fields = FULL_FIELDS if per_token else tuple(f for f in FULL_FIELDS if f not in ("tokens", "logprobs"))
    qs = RolloutSample.objects.filter(run_id=run_id).order_by("seq", "id")
    if not per_token:
        qs = qs.defer("tokens", "logprobs")
    for s in qs.iterator(chunk_size=200):
        yield as_json(s, fields, words=False)
