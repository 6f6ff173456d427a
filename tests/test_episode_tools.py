"""Episode tools (trainer/episode/tools.py): the strict call parsers, the calculator, and the python
tool in the code sandbox, whose every failure is a result, never an exception or harm to the caller."""
import os
import time
from pathlib import Path

import pytest

from trainer.episode import tools as T
from trainer.episode.tools import ToolCall, ToolCallError, parse_call, run_tool, stop_strings
from trainer.sandbox.snippet import TRUNCATED, clip, run_snippet

REPO = Path(__file__).resolve().parents[1]
CALC = ToolCall("calculator", {"expression": "1"})
NEEDS = "calculator needs the argument 'expression' (a string)"


def call_json(name="calculator", arguments='{"expression": "2+3"}'):
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def calc(expression, **kw):
    return run_tool(ToolCall("calculator", {"expression": expression}), timeout_s=1, **kw)


def python(code, timeout_s=5.0, **kw):
    return run_tool(ToolCall("python", {"code": code}), timeout_s=timeout_s, **kw)


def children() -> set[int]:
    """Pids of this process's live children (from /proc)."""
    me, kids = str(os.getpid()), set()
    for name in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if name.isdigit() and fields[1] == me and fields[0] != "Z":
            kids.add(int(name))
    return kids


# --- stop strings and parsing --------------------------------------------------------------------

def test_stop_strings_are_the_closing_tags_of_the_offered_tools():
    assert stop_strings("tag", ["calculator"]) == ["</calc>"]
    assert stop_strings("tag", T.TOOLS) == ["</calc>", "</python>"]
    assert stop_strings("json", ["python"]) == ["</tool_call>"]
    with pytest.raises(ValueError, match="unknown tool-call syntax 'xml'"):
        stop_strings("xml", ["calculator"])
    with pytest.raises(ValueError, match="tools must be some of calculator, python"):
        stop_strings("tag", ["search"])


@pytest.mark.parametrize("text, expected", [
    ("<calc>23+58*2</calc>", ToolCall("calculator", {"expression": "23+58*2"})),
    ("Let me add. <calc> 23 + 58 </calc> \n", ToolCall("calculator", {"expression": "23 + 58"})),
    ("<python>print(1+2)</python>", ToolCall("python", {"code": "print(1+2)"})),
    ("<python>\n  x = 2\n  print(x)\n</python>", ToolCall("python", {"code": "x = 2\nprint(x)"})),
    # a tag inside the code is code; an earlier call in the turn is not this one
    ('<python>print("<python>")</python>', ToolCall("python", {"code": 'print("<python>")'})),
    ("<calc>1+1</calc> = 2, and <calc>2*3</calc>", ToolCall("calculator", {"expression": "2*3"})),
    ("The answer is 172.", None),
    ("<answer>172</answer>", None),   # not a tool's tag: an answer
    ("", None),
])
def test_tag_syntax_reads_the_call_that_ends_the_turn(text, expected):
    assert parse_call(text, "tag", T.TOOLS) == expected


@pytest.mark.parametrize("text, tools, message", [
    ("<calc>23+58", T.TOOLS, "'<calc>' without its closing '</calc>'"),
    ("<python>print(1)", T.TOOLS, "'<python>' without its closing '</python>'"),
    ("23+58</calc>", T.TOOLS, "'</calc>' without its opening '<calc>'"),
    ("so 23+58</calc> is 81", T.TOOLS, "'</calc>' without its opening '<calc>'"),
    ("<python>print(1)</python>", ["calculator"], "unknown tool 'python'; the tools are calculator"),
    ("<calc>2+2</calc> so it is 4", T.TOOLS, "text after '</calc>': a tool call must end the turn"),
    ("<calc>  </calc>", T.TOOLS, "the calculator call is empty"),
])
def test_tag_syntax_refuses_malformed_calls_saying_why(text, tools, message):
    with pytest.raises(ToolCallError) as e:
        parse_call(text, "tag", tools)
    assert message in str(e.value)


@pytest.mark.parametrize("text, expected", [
    (call_json(), ToolCall("calculator", {"expression": "2+3"})),
    ("I should add them.\n<tool_call>\n  " + call_json()[11:-12] + "\n</tool_call>\n",
     ToolCall("calculator", {"expression": "2+3"})),
    (call_json(arguments='"{\\"expression\\": \\"2+3\\"}"'), ToolCall("calculator", {"expression": "2+3"})),
    (call_json("python", '{"code": "print(1)"}'), ToolCall("python", {"code": "print(1)"})),
    (call_json(arguments='{"expression": "1"}') + " " + call_json(),
     ToolCall("calculator", {"expression": "2+3"})),
    ("The answer is 5.", None),
])
def test_json_syntax_reads_the_last_call(text, expected):
    assert parse_call(text, "json", T.TOOLS) == expected


@pytest.mark.parametrize("text, message", [
    ('<tool_call>{"name": "calculator" "arguments": {}}</tool_call>',
     "tool call is not valid JSON: Expecting ',' delimiter at char 22"),
    (call_json("foo"), "unknown tool 'foo'; the tools are calculator"),
    (call_json("python", '{"code": "1"}'), "unknown tool 'python'; the tools are calculator"),
    ('<tool_call>{"arguments": {"expression": "1"}}</tool_call>', 'the tool call needs "name" (a string)'),
    ('<tool_call>["calculator"]</tool_call>', "a tool call is a JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": {}, "id": 1}</tool_call>', "unexpected key 'id'"),
    ('<tool_call>{"name": "calculator"}</tool_call>', NEEDS),
    (call_json(arguments='{}'), NEEDS),
    (call_json(arguments='{"expression": 5}'), NEEDS + ", got a number"),
    (call_json(arguments='["2+3"]'), '"arguments" must be an object, got a list'),
    (call_json(arguments='{"expression": "1", "x": "2"}'),
     "calculator takes only the argument 'expression', got 'x'"),
    (call_json(arguments='"{expression: 1}"'), '"arguments" is not valid JSON: Expecting property name'),
    (call_json(arguments='{"expression": " "}'), "calculator's 'expression' is empty"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}',
     "'<tool_call>' without its closing '</tool_call>'"),
    ('{"name": "calculator"}</tool_call>', "'</tool_call>' without its opening '<tool_call>'"),
    (call_json() + " Done.", "text after '</tool_call>': a tool call must end the turn"),
])
def test_json_syntax_refuses_malformed_calls_saying_why(text, message):
    with pytest.raises(ToolCallError) as e:
        parse_call(text, "json", ["calculator"])
    assert message in str(e.value)


def test_a_parse_error_becomes_the_text_the_model_is_told():
    with pytest.raises(ToolCallError) as e:
        parse_call(call_json("foo"), "json", ["calculator"])
    assert T.format_error(e.value) == "error: unknown tool 'foo'; the tools are calculator"
    assert T.format_error("timed out after 2s") == "error: timed out after 2s"
    assert T.format_error(KeyError()) == "error: KeyError"


def test_an_error_is_short_and_marked_where_it_is_cut():
    """A failed call's message takes little of a short response budget (the agent preset's 96
    tokens held 76 tokens of one): at most ERROR_CHARS, cut at a word and marked with CUT."""
    long = "the call " + "went very wrong " * 20
    text = T.format_error(long)
    assert len(text) <= T.ERROR_CHARS and text.endswith(T.CUT), text
    assert (text[:-len(T.CUT)] + " ").startswith("error: the call went very wrong ")
    assert long.startswith(text[len("error: "):-len(T.CUT)] + " "), text   # cut at a word's end
    short = "error: unknown tool 'foo'; the tools are calculator"
    assert T.format_error("unknown tool 'foo'; the tools are calculator") == short   # whole: no mark
    # a model's long tool name, from the parser and from run_tool; a long python error line
    env_text = T.format_error(ToolCallError(T._unknown("x" * 300, ["calculator"])))
    assert len(env_text) <= T.ERROR_CHARS and env_text.endswith(T.CUT), env_text
    r = run_tool(ToolCall("y" * 300, {}), timeout_s=1)
    assert r.error and len(r.text) <= T.ERROR_CHARS and r.text.endswith(T.CUT), r.text
    r = python("raise ValueError('" + "bad value " * 40 + "')")
    assert r.error and r.text.startswith("error: ValueError: bad value bad value"), r.text
    assert len(r.text) <= T.ERROR_CHARS and r.text.endswith(T.CUT), r.text


# --- calculator ----------------------------------------------------------------------------------

@pytest.mark.parametrize("expression, text", [
    ("23+58+91", "172"), ("7/2", "3.5"), ("2**10", "1024"), ("(3+4)*5", "35"), ("-3 + +4", "1"),
    ("17 // 5", "3"), ("17 % 5", "2"), ("2.5*2", "5.0"), (" 6 * 7 ", "42"), ("2**-1", "0.5"),
    ("123456789*987654321", "121932631112635269"),   # ints stay exact
])
def test_calculator_computes_exactly(expression, text):
    r = calc(expression)
    assert (r.text, r.error) == (text, False) and 0 <= r.seconds < 1


@pytest.mark.parametrize("expression, message", [
    ("__import__('os')", "does not take function calls"),
    ("abs(-2)", "does not take function calls"),
    ("x + 1", "does not take names ('x')"),
    ("(1).real", "does not take attributes"),
    ("'a' * 3", "does not take a string constant"),
    ("2**10000", "more than 1000 digits"),
    ("9**9**9", "more than 1000 digits"),       # refused before it is computed
    ("10**999 * 10**999", "more than 1000 digits"),
    ("1e308 * 10", "the result is too large"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "not an arithmetic expression"),
    ("1" + "+1" * 600, "longer than 1000 characters"),
    ("1/0", "division by zero"), ("1//0", "division by zero"), ("1 % 0", "division by zero"),
    ("1.5/0", "division by zero"),
])
def test_calculator_refuses_what_is_not_arithmetic(expression, message):
    t0 = time.monotonic()
    r = calc(expression)
    assert r.error and r.text.startswith("error: ") and message in r.text
    assert time.monotonic() - t0 < 1
    if message == "division by zero":
        assert r.text == "error: division by zero"


def test_calculator_result_is_bounded():
    r = calc("2**1000", max_output_chars=50)
    assert not r.error and len(r.text) == 50 and r.text.endswith(TRUNCATED)


# --- python in the sandbox -----------------------------------------------------------------------

def test_python_returns_what_it_printed():
    r = python("print(sum(range(10)))")
    assert (r.text, r.error) == ("45", False) and r.seconds > 0
    assert python("x = 1").text == "(no output)"
    assert python("import sys\nprint('a')\nprint('b', file=sys.stderr)\nprint('c')").text == "a\nb\nc"
    # its own directory is writable
    assert python("open('f.txt', 'w').write('hi')\nprint(open('f.txt').read())").text == "hi"


def test_python_error_is_its_last_line_after_what_it_printed():
    r = python("1/0")
    assert (r.text, r.error) == ("error: ZeroDivisionError: division by zero", True)
    r = python("print('step 1')\nraise ValueError('bad value')")
    assert (r.text, r.error) == ("step 1\nerror: ValueError: bad value", True)
    assert python("import sys\nsys.exit(0)").error is False
    assert python("import sys\nsys.exit(2)").text == "error: SystemExit: 2"


def test_infinite_loop_times_out_and_leaves_no_process():
    before = children()
    t0 = time.monotonic()
    r = python("while True:\n    pass", timeout_s=1.0)
    assert (r.text, r.error) == ("error: timed out after 1s", True)
    assert time.monotonic() - t0 < 4 and 0.9 < r.seconds < 4
    assert children() <= before


def test_memory_bombs_are_errors():
    r = python("x = bytearray(1 << 34)")
    assert (r.text, r.error) == ("error: MemoryError", True)
    r = python("x = []\nwhile True:\n    x.append(bytearray(10**7))")
    assert r.error and ("MemoryError" in r.text or "killed" in r.text), r.text


def test_network_is_blocked():
    r = python("import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)")
    assert r.error and "PermissionError: network access is disabled" in r.text, r.text
    r = python("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:80/', timeout=1)")
    assert r.error and "network access is disabled" in r.text, r.text


@pytest.mark.parametrize("path", ["/tmp/rlpilot_escape_test.txt", str(REPO / "rlpilot_escape_test.txt")])
def test_writes_outside_the_sandbox_are_refused(path):
    Path(path).unlink(missing_ok=True)
    r = python(f"open({path!r}, 'w').write('escaped')")
    # refused by the audit hook (the second layer) before the boundary hides the path anyway
    assert r.error and f"writing {path!r} is not allowed" in r.text, r.text
    assert not Path(path).exists()


def test_subprocesses_are_refused():
    r = python("import subprocess\nsubprocess.run(['true'])")
    assert r.error and "subprocess.Popen is not allowed" in r.text, r.text


def test_long_output_is_truncated():
    r = python("print('x' * 5000)", max_output_chars=100)
    assert not r.error and len(r.text) == 100 and r.text == "x" * (100 - len(TRUNCATED)) + TRUNCATED
    # a failure after a long output still says what failed, within the limit
    r = python("print('x' * 5000)\n1/0", max_output_chars=100)
    assert r.error and len(r.text) <= 100 and r.text.endswith("\nerror: ZeroDivisionError: division by zero")


def test_run_snippet_reports_what_it_printed_and_an_early_exit():
    r = run_snippet("print('a' * 50)", timeout_s=5, max_output_chars=20)
    assert (r.status, r.output, r.error) == ("ok", "a" * (20 - len(TRUNCATED)) + TRUNCATED, "")
    # (a report the code writes itself is only its own text: the tool decides no reward, and the
    # code reward's verdict never comes from the sandbox: tests/test_sandbox_hostile.py)
    r = run_snippet("import os\nos._exit(0)", timeout_s=5)
    assert (r.status, r.error) == ("error", "the process exited with code 0")


def test_clip_bounds_text_and_marks_the_cut():
    assert clip("abc", 3) == "abc"
    assert clip("x" * 30, 20) == "x" * 8 + TRUNCATED and len(clip("x" * 30, 20)) == 20
    assert clip("x" * 30, 5) == "xxxxx"


# --- run_tool never raises -----------------------------------------------------------------------

@pytest.mark.parametrize("call, message", [
    (ToolCall("search", {"query": "x"}), "unknown tool 'search'"),
    (ToolCall("calculator", {"expr": "1"}), "calculator takes only the argument 'expression', got 'expr'"),
    (ToolCall("calculator", {"expression": 7}), NEEDS),
    (ToolCall("python", "print(1)"), '"arguments" must be an object, got a string'),
    (ToolCall("python", {}), "python needs the argument 'code' (a string)"),
    (ToolCall("python", {"code": ""}), "python's 'code' is empty"),
    (None, "unknown tool None"),
])
def test_run_tool_turns_a_bad_call_into_an_error_result(call, message):
    r = run_tool(call, timeout_s=1)
    assert r.error and r.text == f"error: {r.text[7:]}" and message in r.text


def test_run_tool_turns_an_unexpected_failure_into_an_error_result(monkeypatch):
    def boom(*args, **kwargs):
        raise OSError("cannot fork")
    monkeypatch.setattr(T, "run_snippet", boom)
    r = python("print(1)")
    assert (r.text, r.error) == ("error: cannot fork", True)
    assert run_tool(CALC, timeout_s=1).text == "1"   # the calculator runs in-process
