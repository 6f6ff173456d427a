"""Math and code tasks read from JSONL files.

One JSON object per line (blank lines are skipped; row numbers count only the objects):

    math: {"prompt": "What is 1/4 + 1/4?", "answer": "\\frac{1}{2}"}        answer: str or number
    code: {"prompt": "Write add(a, b).", "entry_point": "add",
           "tests": "assert add(1, 2) == 3"}                                  tests: str or [str, ...]

"prompt" is a string, or a list of chat messages [{"role": "system" | "user" | "assistant",
"content": "..."}, ...] ending with a user message. Either is rendered to the prompt text by
trainer/tasks/prompts.py (prompt template, system prompt, the tokenizer's chat template).

An optional "id" (str or int) names a row; otherwise its id is "<kind>:<row>" for training rows
and "<kind>:eval:<row>" for rows of the evaluation file. Other fields are ignored.

The whole file is validated when the task is built, so a broken dataset fails at launch with a
`ConfigError` that names the file, the line and the field, not hours into a run. It is read as a
stream, line by line, after its size is checked against `RLPILOT_MAX_DATA_BYTES` (512 MiB by
default): memory grows with the rows kept, never with a whole file read at once.
"""
from __future__ import annotations

import json
import keyword
import math
import os
from pathlib import Path
from typing import Any

from trainer.config import ConfigError
from trainer.tasks.base import Problem, Task
from trainer.tasks.prompts import PromptRenderer, messages_problem

KINDS = ("math", "code")
MAX_DATA_BYTES_DEFAULT = 512 * 2**20
_MAX_REPORTED = 5  # errors listed in one ConfigError message; the rest are counted


class _Row:
    __slots__ = ("id", "text", "answer", "tools")

    def __init__(self, id: str, text: str | list, answer: Any, tools: tuple[str, ...] | None = None):
        self.id, self.text, self.answer, self.tools = id, text, answer, tools


class JsonlTask(Task):
    def __init__(self, path: str, kind: str, template: str = "{prompt}", eval_path: str = "",
                 seed: int = 0, renderer: PromptRenderer | None = None):
        if kind not in KINDS:
            raise ConfigError({"data.task": f"got {kind!r}; a JSONL task is one of "
                                            + ", ".join(repr(k) for k in KINDS)})
        if not isinstance(template, str) or "{prompt}" not in template:
            raise ConfigError({"data.prompt_template": "must contain '{prompt}'"})
        self.name = kind
        self.kind = kind
        self.template = template
        self.renderer = renderer if renderer is not None else PromptRenderer(template=template)
        self.seed = seed
        self.path = str(path)
        self.eval_path = str(eval_path or "")
        self._train = _load(self.path, kind, key="data.path", default_id=f"{kind}:{{row}}")
        self._eval = (_load(self.eval_path, kind, key="data.eval_path",
                            default_id=f"{kind}:eval:{{row}}") if self.eval_path else None)
        self.train_size = len(self._train)
        self._row_of_id: dict[str, int] | None = None
        self._check_rendering()

    # -- Task interface ------------------------------------------------------------------------

    def problem(self, row: int) -> Problem:
        if not 0 <= row < self.train_size:
            raise IndexError(f"row {row} is out of range: {self.path} has {self.train_size} rows")
        return self._make(self._train[row])

    def eval_problems(self, n: int) -> list[Problem]:
        rows = self._eval if self._eval is not None else self._train
        return [self._make(r) for r in rows[:max(0, n)]]

    def problem_ids(self) -> list[str]:
        return [r.id for r in self._train]   # without rendering every prompt

    # -- helpers -------------------------------------------------------------------------------

    @property
    def eval_size(self) -> int:
        """Rows available to eval_problems()."""
        return len(self._eval if self._eval is not None else self._train)

    def index_of(self, problem_id: str) -> int:
        """The training row whose id is `problem_id` (KeyError if there is none)."""
        if self._row_of_id is None:
            self._row_of_id = {r.id: i for i, r in enumerate(self._train)}
        return self._row_of_id[problem_id]

    def _check_rendering(self) -> None:
        """Render the first row (and the first row of messages) now: a chat template that
        refuses them (some refuse a system message) fails at launch, naming the line."""
        for key, rows in (("data.path", self._train), ("data.eval_path", self._eval or [])):
            firsts = [rows[0]] if rows else []
            firsts += [r for r in rows if isinstance(r.text, list)][:1]
            for r in firsts:
                try:
                    self.renderer.render(r.text)
                except Exception as e:  # jinja errors, templates that raise on a role
                    raise ConfigError({"data.chat_template": (
                        f"the chat template of model.path fails on row {r.id!r} of {key}: "
                        f"{type(e).__name__}: {e}"[:500]
                        + " (set data.chat_template = 'none' for plain prompts)")}) from None

    def _make(self, r: _Row) -> Problem:
        # a code answer is copied: a caller that changes it cannot change the dataset
        return Problem(id=r.id, prompt=self.renderer.render(r.text, tools=r.tools),
                       answer=dict(r.answer) if isinstance(r.answer, dict) else r.answer,
                       kind=self.kind, tools=r.tools)


# ---------------------------------------------------------------------------------------------
# Loading and validation
# ---------------------------------------------------------------------------------------------

def _load(path: str, kind: str, *, key: str, default_id: str) -> list[_Row]:
    if not path:
        raise ConfigError({key: f"task={kind!r} needs a JSONL file"})
    p = Path(path)
    if not p.exists():
        raise ConfigError({key: f"{path}: file not found"})
    if not p.is_file():
        raise ConfigError({key: f"{path}: not a regular file"})
    problem = size_problem(p)
    if problem:
        raise ConfigError({key: problem})
    limit = max_data_bytes()

    rows: list[_Row] = []
    errors: list[str] = []
    seen_ids: dict[str, int] = {}
    read = 0
    try:
        with p.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                read += len(raw)
                if read > limit:  # the file grew after its size was checked
                    raise ConfigError({key: f"{path}: grew past {_mib(limit)} while being read "
                                            "(RLPILOT_MAX_DATA_BYTES)"})
                if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]  # UTF-8 byte-order mark
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw.decode("utf-8"))
                    row = _parse_row(obj, kind, row=len(rows), default_id=default_id)
                    if row.id in seen_ids:
                        raise _RowError(f"duplicate id {row.id!r} (first used on line {seen_ids[row.id]})")
                except UnicodeDecodeError:
                    errors.append(f"line {lineno}: not valid UTF-8")
                    continue
                except json.JSONDecodeError as e:
                    errors.append(f"line {lineno}: invalid JSON ({e.msg} at column {e.colno})")
                    continue
                except _RowError as e:
                    errors.append(f"line {lineno}: {e}")
                    continue
                seen_ids[row.id] = lineno
                rows.append(row)
    except OSError as e:
        raise ConfigError({key: f"{path}: cannot read: {e.strerror or e}"}) from None
    if errors:
        shown = errors[:_MAX_REPORTED]
        more = len(errors) - len(shown)
        msg = f"{path}: " + "; ".join(shown) + (f"; ... and {more} more bad lines" if more else "")
        raise ConfigError({key: msg})
    if not rows:
        raise ConfigError({key: f"{path}: no problems in the file (it is empty)"})
    return rows


class _RowError(ValueError):
    pass


def max_data_bytes() -> int:
    """The largest data file a run may read (`RLPILOT_MAX_DATA_BYTES`, bytes)."""
    raw = os.environ.get("RLPILOT_MAX_DATA_BYTES", "").strip()
    if not raw:
        return MAX_DATA_BYTES_DEFAULT
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError({"RLPILOT_MAX_DATA_BYTES": f"must be a whole number of bytes, got {raw[:40]!r}"}) from None
    if value <= 0:
        raise ConfigError({"RLPILOT_MAX_DATA_BYTES": f"must be positive, got {value}"})
    return value


def size_problem(path: str | Path) -> str | None:
    """Why the data file at `path` is too big to read, or None (also None when it is missing:
    that is reported where the file is opened)."""
    try:
        size = Path(path).stat().st_size
    except OSError:
        return None
    limit = max_data_bytes()
    if size > limit:
        return (f"{path}: {_mib(size)} is larger than the {_mib(limit)} a data file may have "
                "(RLPILOT_MAX_DATA_BYTES)")
    return None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def _parse_row(obj: Any, kind: str, *, row: int, default_id: str) -> _Row:
    if not isinstance(obj, dict):
        raise _RowError(f"expected a JSON object, got {_type_name(obj)}")
    if "prompt" in obj and not isinstance(obj["prompt"], (str, list)):
        raise _RowError(f"'prompt' must be a string or a list of messages, got {_type_name(obj['prompt'])}")
    text = _field(obj, "prompt", (str, list))
    if isinstance(text, list):
        problem = messages_problem(text)
        if problem:
            raise _RowError(f"'prompt': {problem}")
    elif not text.strip():
        raise _RowError("'prompt' is empty")
    if "id" in obj and obj["id"] is not None:
        raw_id = obj["id"]
        if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
            raise _RowError(f"'id' must be a string or an integer, got {_type_name(raw_id)}")
        pid = str(raw_id)
        if not pid.strip():
            raise _RowError("'id' is empty")
    else:
        pid = default_id.format(row=row)
    tools = _tools(obj)

    if kind == "math":
        answer = _field(obj, "answer", (str, int, float))
        if isinstance(answer, bool):
            raise _RowError("'answer' must be a string or a number, got a boolean")
        if isinstance(answer, float) and not math.isfinite(answer):
            raise _RowError(f"'answer' must be a finite number, got {answer}")
        if isinstance(answer, str) and not answer.strip():
            raise _RowError("'answer' is empty")
        return _Row(pid, text, answer, tools)

    tests = _field(obj, "tests", (str, list))
    if isinstance(tests, list):
        if not tests:
            raise _RowError("'tests' is an empty list")
        for i, t in enumerate(tests):
            if not isinstance(t, str):
                raise _RowError(f"'tests'[{i}] must be a string of Python code, got {_type_name(t)}")
        test_list = list(tests)
    else:
        test_list = [tests]
    for i, t in enumerate(test_list):
        where = "'tests'" if isinstance(tests, str) else f"'tests'[{i}]"
        if not t.strip():
            raise _RowError(f"{where} is empty")
        try:
            compile(t, "<tests>", "exec", dont_inherit=True)
        except SyntaxError as e:
            raise _RowError(f"{where} is not valid Python: {e.msg} (line {e.lineno} of the tests)") from None
        except ValueError as e:  # e.g. null bytes
            raise _RowError(f"{where} is not valid Python: {e}") from None
    entry_point = _field(obj, "entry_point", str)
    if not entry_point.isidentifier() or keyword.iskeyword(entry_point):
        raise _RowError(f"'entry_point' must be a Python function name, got {entry_point!r}")
    return _Row(pid, text, {"tests": tests if isinstance(tests, str) else test_list,
                            "entry_point": entry_point}, tools)


def _tools(obj: dict) -> tuple[str, ...] | None:
    """The row's own tools (multi-turn runs: instead of `episode.tools`), or None."""
    if obj.get("tools") is None:
        return None
    from trainer.episode.tools import TOOLS

    value = obj["tools"]
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise _RowError(f"'tools' must be a list of tool names, got {_type_name(value)}")
    unknown = [t for t in value if t not in TOOLS]
    if unknown:
        raise _RowError(f"'tools': unknown tool {unknown[0]!r}; the tools are {', '.join(TOOLS)}")
    return tuple(dict.fromkeys(value))


def _field(obj: dict, name: str, types) -> Any:
    if name not in obj:
        raise _RowError(f"missing {name!r}")
    value = obj[name]
    if not isinstance(value, types):
        want = {str: "a string", list: "a list", int: "a number", float: "a number"}
        names = []
        for t in (types if isinstance(types, tuple) else (types,)):
            if want[t] not in names:
                names.append(want[t])
        raise _RowError(f"{name!r} must be {' or '.join(names)}, got {_type_name(value)}")
    return value


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(v), type(v).__name__)
