"""Reference pages generated from the code, so that they cannot drift from it.

    python -m trainer docs config            # print docs/configuration.md
    python -m trainer docs config --write    # rewrite docs/configuration.md in the repository
    python -m trainer docs config --check    # exit 1 when docs/configuration.md is stale

`config` renders the one schema (`trainer.config.schema()`): one table per section with every
parameter's key, type, default, range or choices, whether it is a knob (may change during a run)
and its help, then every shipped preset and what it sets. tests/test_docs.py regenerates the page
and fails when the committed one differs.
"""
from __future__ import annotations

import argparse
import re
import sys
import tomllib
from importlib import resources
from pathlib import Path

from trainer import config as config_mod

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DOC = REPO_ROOT / "docs" / "configuration.md"
REGENERATE = "python -m trainer docs config --write"

# One line per section: what it is about (a section missing here is still documented).
SECTION_INTRO = {
    "model": "Which model is trained and where it runs.",
    "data": "The task: the built-in list-sum task or a JSONL file of math or code problems.",
    "rollout": "Generation: the engine, group size, batch size, sampling, DAPO dynamic sampling.",
    "algo": "The objective: GRPO/DAPO clipping, KL, advantages, the overlong penalty.",
    "optim": "The optimiser (AdamW) and how an update is split into micro-batches.",
    "april": "APRIL active partial rollouts (see algorithms.md).",
    "greso": "GRESO selective rollouts (see algorithms.md).",
    "async": "Asynchronous training, AReaL style (see algorithms.md).",
    "run": "Length of the run, seeds, checkpoints, evaluation, the reward pool.",
    "cluster": "Processes: training ranks under torchrun and generation processes (see scaling.md).",
    "pilot": "The autopilot: which rules' advice it applies itself, its bounds, pace and guards (see pilot.md).",
}

# The switches that turn a technique on, for the preset summaries.
TECHNIQUES = [("april.enabled", "APRIL"), ("greso.enabled", "GRESO"),
              ("rollout.dynamic_sampling", "dynamic sampling"), ("async.enabled", "asynchronous")]

HEADER = f"""\
# Configuration

<!-- Generated from trainer/config/ and trainer/presets/ by `{REGENERATE}`.
     Do not edit by hand: tests/test_docs.py fails when this page is stale. -->

Every parameter of a run is declared once, in `trainer/config/sections.py`: its type,
default, allowed range or choices, one line of help, and whether it is a **knob** (may change
while the run goes on). The command line, the launch form, the live-tuning panel and the JSON API
(`GET /api/knobs`) all read that schema; this page is generated from it.

- A config is TOML with the sections below. Start from a preset (`trainer/presets/`, listed at
  the end of this page) or a file, then override dotted keys:
  `python -m trainer run demo --set optim.lr=3e-5 --set run.max_steps=50`. A `--set` value is
  read as a TOML value when it parses as one (numbers, booleans, quoted strings), otherwise as a
  bare string.
- Unknown sections and keys, wrong types and out-of-range values are refused, every error at
  once, each naming the key and what is allowed:
  `error: optim.lr: got 5; expected a number in [0.0, 1.0]`. Rules that involve several keys
  (e.g. `task = "math"` needs `data.path`) are checked by `check()` (`trainer/config/checks.py`).
- Text values must not hold a NUL character or a lone UTF-16 surrogate and are at most
  {config_mod.MAX_TEXT_LEN:,} characters long (they must survive the database and TOML).
- Knobs change at the next step boundary, from `python -m trainer control RUN_DIR --set k=v`, the
  dashboard's tuning panel, the WebSocket or `POST /api/runs/<id>/knobs`. A change is applied
  whole or not at all and recorded as a `knob_applied` event (old -> new, who, at which step) or
  a `knob_rejected` one. Everything else is fixed for the run's life (a resume may still
  `--set` it, and a fork, `run --fork RUN_DIR --from-step N`, starts a new run from a
  checkpoint with any of it changed, except what the checkpoint cannot carry: `model.path`,
  the keys that define the training problems, and the group size while it holds partial
  rollouts; see `carry_problems` in `trainer/run/state.py`).
- `python -m trainer knobs` prints the knobs, `--all` every parameter, `--json` the schema as
  the API serves it.
"""


def configuration_markdown() -> str:
    """The text of docs/configuration.md."""
    specs = config_mod.schema()
    sections: dict[str, list] = {}
    for p in specs:
        sections.setdefault(p.name.split(".")[0], []).append(p)
    out = [HEADER]
    out.append("Sections: " + ", ".join(f"[`{s}`](#{s})" for s in sections) + "; "
               "then [all knobs](#knobs-at-a-glance) and [the presets](#presets).\n")
    for section, params in sections.items():
        out.append(f"## {section}\n")
        if SECTION_INTRO.get(section):
            out.append(SECTION_INTRO[section] + "\n")
        out.append("| key | type | default | range / choices | knob | help |")
        out.append("|---|---|---|---|---|---|")
        for p in params:
            out.append("| " + " | ".join([
                f"`{p.name}`", config_mod.TYPE_NAMES[p.type], f"`{_value(p.default)}`",
                _allowed(p), "knob" if p.tunable else "", _cell(p.help)]) + " |")
        out.append("")
    out.append("## Knobs at a glance\n")
    out.append("The parameters that may change during a run (applied at the next step boundary):\n")
    for section, params in sections.items():
        knobs = [p for p in params if p.tunable]
        if knobs:
            out.append(f"- `{section}`: " + ", ".join(f"`{p.name.split('.', 1)[1]}`" for p in knobs))
    out.append("")
    out.append(_presets_markdown())
    return "\n".join(out).rstrip() + "\n"


def _presets_markdown() -> str:
    defaults = {p.name: p.default for p in config_mod.schema()}
    out = ["## Presets\n",
           "Shipped in `trainer/presets/`; `python -m trainer presets --json` prints each in full "
           "(`{name: {requires, config}}`; `requires`: what an opt-in preset needs, else null). "
           "A preset sets only the keys its file names; every other key keeps its schema default. "
           "Each table lists what a preset changes from the defaults.\n"]
    for name in config_mod.preset_names():
        text = resources.files(config_mod.PRESETS_PACKAGE).joinpath(name + ".toml").read_text()
        cfg = config_mod.load(name)
        on = [label for key, label in TECHNIQUES if cfg.get(key)]
        out.append(f"### `{name}`\n")
        summary = _first_sentence(text)
        if summary:
            out.append(f"> {summary}\n")
        out.append("Techniques on: " + (", ".join(on) if on else "none (the synchronous GRPO loop)")
                   + f". Run it with `python -m trainer run {name}`.\n")
        notes = _inline_comments(text)
        out.append("| key | preset | schema default | note |")
        out.append("|---|---|---|---|")
        restated = []
        for section, values in tomllib.loads(text).items():
            for key, value in values.items():
                dotted = f"{section}.{key}"
                default = defaults.get(dotted)
                if default == value and type(default) is type(value) and dotted not in notes:
                    restated.append(dotted)
                    continue
                out.append(f"| `{dotted}` | `{_value(value)}` | `{_value(default)}` | "
                           f"{_cell(notes.get(dotted, ''))} |")
        out.append("")
        if restated:
            out.append("The file also sets, to their defaults: "
                       + ", ".join(f"`{k}`" for k in restated) + ".\n")
    return "\n".join(out)


def _first_sentence(toml_text: str) -> str:
    """The first sentence of the comment block a preset file starts with."""
    lines = []
    for line in toml_text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines).strip()
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    return _cell(m.group(1) if m else text)


def _inline_comments(toml_text: str) -> dict[str, str]:
    """{section.key: comment} for `key = value  # comment` lines of a preset file."""
    notes, section = {}, ""
    for line in toml_text.splitlines():
        s = line.strip()
        if s.startswith("[") and s.endswith("]"):
            section = s[1:-1].strip()
            continue
        m = re.match(r"(\w+)\s*=\s*(.*?)\s+#\s*(.*)$", s)
        if not m:
            continue
        try:  # the comment starts after a complete value (not a '#' inside a string)
            tomllib.loads(f"v = {m.group(2)}")
        except tomllib.TOMLDecodeError:
            continue
        notes[f"{section}.{m.group(1)}"] = m.group(3)
    return notes


def _value(v) -> str:
    """A value as it is written in TOML (and in --set)."""
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return f"{v:_}" if abs(v) >= 100_000 else str(v)
    if isinstance(v, float):
        if v.is_integer() and abs(v) >= 100_000:
            mantissa, exp = f"{v:.0e}".split("e")
            return f"{mantissa}e{int(exp)}"
        return repr(v)
    if v is None:
        return ""
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _allowed(p) -> str:
    if p.type is list:
        return "list of " + (", ".join(f"`{c}`" for c in p.choices) if p.choices else "text")
    if p.choices:
        return ", ".join(f"`{c}`" for c in p.choices)
    if p.type is bool:
        return "true, false"
    if p.type in (int, float):
        lo = "-inf" if p.min is None else _value(p.type(p.min))
        hi = "inf" if p.max is None else _value(p.type(p.max))
        return f"[{lo}, {hi}]"
    return "text"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


# --- command line ---------------------------------------------------------------------------------

PAGES = {"config": (configuration_markdown, CONFIG_DOC)}


def add_parser(sub) -> None:
    d = sub.add_parser("docs", help="generate reference pages from the code (docs/)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("page", choices=sorted(PAGES), help="config: docs/configuration.md")
    mode = d.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the page in docs/")
    mode.add_argument("--check", action="store_true", help="exit 1 when the page in docs/ is stale")
    d.set_defaults(func=_cmd_docs)


def _cmd_docs(args) -> int:
    render, path = PAGES[args.page]
    text = render()
    if args.write:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
        return 0
    if args.check:
        current = path.read_text(encoding="utf-8") if path.is_file() else ""
        if current != text:
            print(f"{path} is stale: run `{REGENERATE}`", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    sys.stdout.write(text)
    return 0
