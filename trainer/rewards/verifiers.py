"""The math and code verifiers: a completion and a problem's answer -> 0.0 or 1.0.

    math  the completion's final answer (the last \\boxed{...}, else the last number or
          expression) is compared with the gold answer by math_verify, so \\boxed{1/2}, 0.5
          and \\frac12 are the same answer
    code  the completion's code runs in the sandbox and the problem's tests in the judge
          (trainer/rewards/judge.py); 1.0 when every test passes

Each is a pure, picklable function of (answer, completion), so the reward pool can run it in a
worker process. The task registry (trainer/tasks/__init__.py) says which task each one scores;
the list task's check lives with its task (trainer/tasks/sum.py).
"""
from __future__ import annotations

import functools
import re
import threading
from typing import Any, NamedTuple

from trainer.rewards.judge import CODE_TIMEOUT_S, CodeResult, judge


class Verdict(NamedTuple):
    """What a verifier with its own time limit (code) says about one completion."""
    score: float
    status: str        # "ok", or "timeout" when the completion ran out of time
    detail: str = ""   # why it failed, if known


# =============================================================================================
# math
# =============================================================================================

_BOXED = re.compile(r"\\(?:boxed|fbox)\b")
# Candidates for an unboxed final answer, scanned left to right; the last one that parses wins.
_CANDIDATE = re.compile(
    r"\$\$(?P<d2>.+?)\$\$|\$(?P<d1>[^$]+?)\$|\\\[(?P<br>.+?)\\\]|\\\((?P<pa>.+?)\\\)"
    r"|(?P<frac>-?\\[dt]?frac\s*(?:\{[^{}]*\}|\d)\s*(?:\{[^{}]*\}|\d))"
    r"|(?P<num>-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|-?\.\d+)",
    re.S)
_MAX_CANDIDATES = 4   # unboxed candidates tried, from the end, before giving up
_MAX_ANSWER_CHARS = 1000


def last_boxed(text: str) -> str | None:
    """The content of the last well-formed \\boxed{...} (or \\fbox{...}, \\boxed 5) in `text`."""
    for m in reversed(list(_BOXED.finditer(text))):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                c = text[j]
                if c == "\\":  # skip escaped characters such as \{ and \}
                    j += 2
                    continue
                if c == "{":
                    depth += 1
                elif c == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j]
                j += 1
            continue  # unbalanced: try an earlier box
        if i > m.end():  # "\boxed 5"
            tok = re.match(r"[^\s$]+", text[i:])
            if tok:
                return tok.group(0)
    return None


def extract_answer(completion: str) -> list[str]:
    """Candidate final answers of a completion, best first: the last \\boxed{} if there is one,
    else the last few LaTeX segments / fractions / numbers, from the end backwards."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return [boxed]
    found = []
    for m in _CANDIDATE.finditer(completion):
        found.append(next(v for v in m.groupdict().values() if v is not None))
    return found[::-1][:_MAX_CANDIDATES]


def _mv_timeout() -> int | None:
    # math_verify enforces its time limits with SIGALRM, which works in the main thread only.
    return 5 if threading.current_thread() is threading.main_thread() else None


def _clean(text: str) -> str:
    return text.strip().rstrip(".,;:!").strip()


def _parse_latex(text: str) -> list:
    from math_verify import parse
    text = _clean(text)[:_MAX_ANSWER_CHARS]
    if not text:
        return []
    t = _mv_timeout()
    parsed = parse(f"${text}$", parsing_timeout=t)
    if not parsed:
        parsed = parse(text, parsing_timeout=t)
    return parsed


@functools.lru_cache(maxsize=8192)
def _parse_gold(answer: str) -> tuple:
    if "\\boxed" in answer or "$" in answer:
        from math_verify import parse
        return tuple(parse(answer, parsing_timeout=_mv_timeout()))
    return tuple(_parse_latex(answer))


_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")


def _normalize_text(s: str) -> str:
    s = _TEXT_WRAPPER.sub(r"\1", s)
    s = s.replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\ ", "")
    return re.sub(r"\s+", "", _clean(s)).lower()


def score_math(answer: Any, completion: str) -> float:
    """1.0 when the completion's final answer equals `answer` mathematically, else 0.0."""
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a string, got {type(completion).__name__}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise TypeError(f"a math answer must be a string or a number, got {answer!r}")
    gold_text = answer if isinstance(answer, str) else repr(answer)
    gold = _parse_gold(gold_text)
    candidates = extract_answer(completion)
    if not candidates:
        return 0.0
    from math_verify import verify
    t = _mv_timeout()
    for cand in candidates:
        pred = _parse_latex(cand)
        if pred:
            if gold and verify(list(gold), pred, timeout_seconds=t):
                return 1.0
            # The last parseable candidate is the model's answer: don't fall back to earlier ones.
            return 1.0 if _normalize_text(cand) == _normalize_text(gold_text) else 0.0
    # Nothing parsed (e.g. a textual answer): exact match of the boxed text.
    return 1.0 if _normalize_text(candidates[0]) == _normalize_text(gold_text) else 0.0


def warm_math() -> None:
    """Import math_verify and sympy and warm their caches (a reward worker, before its first batch)."""
    score_math("1", "\\boxed{1}")


# =============================================================================================
# code
# =============================================================================================

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_CODE_LANGS = {"", "python", "py", "python3", "py3"}


def extract_code(completion: str, entry_point: str | None = None) -> str:
    """The Python code of a completion: the last ```python fenced block (the last one that
    defines `entry_point`, if any does), or the whole completion when it has no fences."""
    blocks = [m.group(2) for m in _FENCE.finditer(completion) if m.group(1).lower() in _CODE_LANGS]
    if not blocks:
        return completion
    if entry_point:
        pat = re.compile(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(|"
                         rf"^\s*{re.escape(entry_point)}\s*=", re.M)
        defining = [b for b in blocks if pat.search(b)]
        if defining:
            return defining[-1]
    return blocks[-1]


def score_code(answer: dict, completion: str, timeout_s: float = CODE_TIMEOUT_S) -> float:
    """1.0 when the completion defines answer['entry_point'] and passes answer['tests']."""
    return 1.0 if _run_answer(answer, completion, timeout_s).passed else 0.0


def _run_answer(answer: dict, completion: str, timeout_s: float) -> CodeResult:
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a string, got {type(completion).__name__}")
    if not isinstance(answer, dict) or "tests" not in answer or "entry_point" not in answer:
        raise TypeError("a code answer must be a dict with 'tests' and 'entry_point', "
                        f"got {answer!r:.200}")
    tests = answer["tests"]
    tests = [tests] if isinstance(tests, str) else list(tests)
    entry_point = answer["entry_point"]
    return judge(extract_code(completion, entry_point), tests, entry_point, timeout_s=timeout_s)


def check_code(answer: dict, completion: str, timeout_s: float) -> Verdict:
    """score_code within `timeout_s` seconds, saying whether the run ran out of time."""
    r = _run_answer(answer, completion, timeout_s)
    if r.status == "timeout":
        return Verdict(0.0, "timeout", r.detail)
    return Verdict(1.0 if r.passed else 0.0, "ok", r.detail)
