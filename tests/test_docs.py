"""The documentation stays true to the code: README.md and docs/*.md.

- docs/configuration.md is generated from the schema (`python -m trainer docs config --write`)
  and must match what the generator prints now;
- every repository path, relative link and anchor they name exists, and so does every command
  (`python -m trainer X`, `bench X`, `manage.py X`) and test file they name;
- every setting read from the environment is documented;
- nothing in the repository points outside it (a design document or notes kept next to it), nor
  names an issue number of the tracker.
"""
from __future__ import annotations

import difflib
import os
import re
import subprocess
from pathlib import Path

import pytest

from trainer.cli import docs
from trainer.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = ["design", "configuration", "algorithms", "engines", "dashboard", "operations", "benchmarks"]


def doc_files() -> list[Path]:
    return [README] + sorted(DOCS.glob("*.md"))


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# --- the generated page ---------------------------------------------------------------------------

def test_configuration_page_matches_the_schema():
    want = docs.configuration_markdown()
    have = text(docs.CONFIG_DOC) if docs.CONFIG_DOC.is_file() else ""
    if have != want:
        diff = "".join(list(difflib.unified_diff(
            have.splitlines(True), want.splitlines(True), "docs/configuration.md (committed)",
            "docs/configuration.md (from the schema)"))[:60])
        pytest.fail(f"docs/configuration.md is stale: regenerate it with `{docs.REGENERATE}` "
                    f"and commit it.\n{diff}")


def test_configuration_page_lists_every_parameter_and_preset():
    from trainer import config

    page = docs.configuration_markdown()
    for p in config.schema():
        assert f"| `{p.name}` |" in page, p.name
    for name in config.preset_names():
        assert f"### `{name}`" in page, name


def test_docs_command_prints_and_checks_the_page(capsys):
    assert cli.main(["docs", "config"]) == 0
    assert capsys.readouterr().out == docs.configuration_markdown()
    assert cli.main(["docs", "config", "--check"]) == 0


# --- the pages ------------------------------------------------------------------------------------

def test_readme_is_short_and_names_the_two_commands():
    readme = text(README)
    assert "make run" in readme and "make test" in readme
    n = len(readme.splitlines())
    assert n <= 200, f"README.md has {n} lines; move the detail to docs/"


def test_every_docs_page_exists_and_the_readme_links_it():
    readme = text(README)
    for page in PAGES:
        assert (DOCS / f"{page}.md").is_file(), page
        assert f"(docs/{page}.md)" in readme, f"README.md does not link docs/{page}.md"


# Paths as prose writes them: trainer/config.py, webapp/dashboard/, tests/fakes/sglang_standin.py
REPO_PATH = re.compile(r"(?<![\w./$-])((?:trainer|webapp|tests|static|docs|templates)/[\w./-]*)")
TEST_FILE = re.compile(r"(?<![\w/])(test_\w+\.py)\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_repository_path_named_in_the_docs_exists():
    missing = []
    for f in doc_files():
        for m in REPO_PATH.finditer(text(f)):
            path = m.group(1).rstrip(".,:;")
            if not (ROOT / path).exists():
                missing.append(f"{f.relative_to(ROOT)}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_every_test_file_named_in_the_docs_exists():
    tests = {p.name for p in (ROOT / "tests").rglob("test_*.py")}
    missing = [f"{f.relative_to(ROOT)}: {m.group(1)}" for f in doc_files()
               for m in TEST_FILE.finditer(text(f)) if m.group(1) not in tests]
    assert not missing, "test files that do not exist:\n" + "\n".join(missing)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    in_code = False
    for line in text(path).splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_relative_link_and_anchor_resolves():
    bad = []
    for f in doc_files():
        for m in LINK.finditer(text(f)):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):   # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            if not dest.exists():
                bad.append(f"{f.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{f.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_every_command_named_in_the_docs_exists():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    trainer_cmds = set(sub.choices)
    bench = next(a for a in sub.choices["bench"]._actions if a.dest == "bench")
    bench_cmds = set(bench.choices)
    manage_cmds = {p.stem for p in (ROOT / "webapp/dashboard/management/commands").glob("*.py")
                   if not p.stem.startswith("_")}
    manage_cmds |= {"migrate", "check", "createsuperuser", "changepassword", "collectstatic",
                    "shell", "runserver"}   # Django's own
    bad = []
    for f in doc_files():
        t = text(f)
        bad += [f"{f.name}: python -m trainer {c}" for c in
                re.findall(r"python -m trainer ([a-z][\w-]*)", t) if c not in trainer_cmds]
        bad += [f"{f.name}: bench {c}" for c in
                re.findall(r"(?:trainer |`)bench ([a-z]\w*)", t) if c not in bench_cmds]
        bad += [f"{f.name}: manage.py {c}" for c in
                re.findall(r"manage\.py ([a-z]\w*)", t) if c not in manage_cmds]
    assert not bad, "commands that do not exist:\n" + "\n".join(bad)


def test_every_benchmark_is_documented_with_its_command():
    page = text(DOCS / "benchmarks.md")
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    bench = next(a for a in sub.choices["bench"]._actions if a.dest == "bench")
    for name in bench.choices:
        assert f"python -m trainer bench {name}" in page, name
    assert "manage.py bench_stream" in page


ENV_READ = re.compile(r"""(?:\benv(?:_bool|_int|_float|_list)?\(\s*|os\.environ(?:\.get)?[\[(]\s*"""
                      r"""|\bgetenv\(\s*)["']([A-Z][A-Z0-9_]+)["']""")


def test_every_setting_read_from_the_environment_is_documented():
    pages = "".join(text(f) for f in doc_files())
    sources = [*(ROOT / "webapp").rglob("*.py"), *(ROOT / "trainer").rglob("*.py"), ROOT / "manage.py"]
    missing = sorted({f"{name} ({p.relative_to(ROOT)})" for p in sources
                      for name in ENV_READ.findall(text(p)) if name not in pages})
    assert not missing, "settings not documented in docs/ (operations.md):\n" + "\n".join(missing)


# --- nothing outside the repository ----------------------------------------------------------------

# a sibling folder of the checkout, or the design document / measurement notes kept there
OUTSIDE = re.compile(r"\.\./shared\b|\b(?:DESIGN|MEASURED)\.md\b")


def _repository_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True, timeout=60).stdout
        files = [ROOT / line for line in out.splitlines() if line]
    except (OSError, subprocess.SubprocessError):   # no git: walk, skipping what git ignores
        skip = {".git", ".venv", "var", "runs", "__pycache__", ".pytest_cache", "build"}
        files = []
        for base, dirs, names in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
            files += [Path(base) / n for n in names]
    return [f for f in files if f.is_file() and f.stat().st_size < 2_000_000]


def test_the_docs_point_nowhere_outside_the_repository():
    bad = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in doc_files()
           for i, line in enumerate(text(f).splitlines(), 1) if OUTSIDE.search(line)]
    assert not bad, "\n".join(bad)


def test_no_file_points_outside_the_repository():
    bad = []
    for f in _repository_files():
        try:
            lines = f.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue   # binary
        bad += [f"{f.relative_to(ROOT)}:{i}: {line.strip()[:120]}"
                for i, line in enumerate(lines, 1) if OUTSIDE.search(line)]
    assert not bad, ("these lines point to a document outside the repository; point them to "
                     "docs/ instead (design.md, benchmarks.md):\n" + "\n".join(bad))


# The tracker's issue numbers mean nothing to a reader of the repository: the docs and the code say
# what a thing does and why, not which ticket asked for it.
ISSUE_NUMBER = re.compile(r"\bissues? ?#?\d+\b|\(#\d+\)", re.IGNORECASE)


def test_no_file_names_an_issue_number():
    files = doc_files() + [f for f in _repository_files() if f.suffix in {".py", ".js", ".html", ".toml"}]
    assert any(f.suffix == ".py" for f in files)   # it read the code too
    bad = [f"{f.relative_to(ROOT)}:{i}: {line.strip()[:120]}" for f in files
           for i, line in enumerate(text(f).splitlines(), 1) if ISSUE_NUMBER.search(line)]
    assert not bad, "lines naming an issue number:\n" + "\n".join(bad)
