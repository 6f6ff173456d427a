"""The tools a model may call in an episode, their strict parsers, and running them.

Two tools: `calculator` (argument `expression`: arithmetic on numbers with + - * / // % **, unary
+/- and parentheses, evaluated from its syntax tree, never `eval`) and `python` (argument `code`:
run in the sandbox, trainer/sandbox/, and answered with what it printed).

A call ends the model's turn (the engine stops at its closing tag, `stop_strings`); only trailing
whitespace may follow it. Two syntaxes:

- "tag", for the built-in character-level model: `<calc>23+58*2</calc>`, `<python>print(1)</python>`.
- "json", for chat models (Hermes / Qwen style), after any reasoning text:
  `<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>`; "arguments"
  may also be a JSON-encoded string. Only the last call of a turn counts.

A malformed call raises `ToolCallError`, whose message is what the model is told. `run_tool` never
raises: a failure (bad arguments, an error in the code, a timeout, a memory or sandbox limit) is its
result's text, "error: ...", with `error=True`, at most ERROR_CHARS long (cut at a word, marked
"..."). Every result's text is at most `max_output_chars` long. Limits: the python tool's
`timeout_s` and the sandbox's memory (`CODE_MEMORY_BYTES`); the calculator refuses expressions
over 1000 characters and integers over 1000 digits.
"""
from __future__ import annotations

import ast
import json
import math
import operator
import textwrap
import time
from dataclasses import dataclass
from typing import Iterable

from trainer.config.values import TOOLS  # the tool names, with the schema (episode.tools)
from trainer.sandbox.snippet import clip, run_snippet

TAG_SYNTAX, JSON_SYNTAX = "tag", "json"
SYNTAXES = (TAG_SYNTAX, JSON_SYNTAX)

ARGUMENT = {"calculator": "expression", "python": "code"}   # each tool's one argument (a string)
TAG = {"calculator": "calc", "python": "python"}            # each tool's tag in the tag syntax
JSON_OPEN, JSON_CLOSE = "<tool_call>", "</tool_call>"

# A failure's message is what the model is told, inside its response budget (environment tokens
# count: the agent preset's 96 tokens once held a 76-token error, cut mid-word): at most
# ERROR_CHARS, cut at a word's end and marked with CUT (ASCII: the built-in character-level
# model's vocabulary has no "…").
ERROR_CHARS = 120
CUT = "..."
MAX_EXPRESSION_CHARS = 1000
MAX_NESTING = 32          # JSON levels a tool call may nest (its arguments are one flat object)
MAX_DIGITS = 1000


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolResult:
    text: str        # what the environment writes back into the conversation (result or error message)
    error: bool      # the call was malformed, the tool failed, timed out, ...
    seconds: float   # wall time the tool took


class ToolCallError(ValueError):
    """A malformed tool call; its message is what the model is told."""


def format_error(err: Exception | str) -> str:
    """The text a failure is written back as: "error: <what went wrong>", at most ERROR_CHARS
    (cut at a word's end, ending with CUT)."""
    if isinstance(err, BaseException):
        err = str(err) or type(err).__name__
    return clip_words(f"error: {err}", ERROR_CHARS)


def clip_words(text: str, limit: int) -> str:
    """`text` in at most `limit` characters: whole when it fits, else cut after its last whole
    word that fits (mid-word only when a word is longer than half the limit), ending with CUT."""
    if len(text) <= limit:
        return text
    head = text[:max(0, limit - len(CUT))]
    space = head.rfind(" ")
    if space > limit // 2:
        head = head[:space]
    return head.rstrip() + CUT


def stop_strings(syntax: str, tools: Iterable[str]) -> list[str]:
    """The strings that end a model turn with a call of one of `tools`."""
    offered = _offered(syntax, tools)
    if syntax == TAG_SYNTAX:
        return [f"</{TAG[name]}>" for name in offered]
    return [JSON_CLOSE]


def parse_call(text: str, syntax: str, tools: Iterable[str]) -> ToolCall | None:
    """The tool call that ends the model turn `text`, or None when it has none (a final answer).
    Raises ToolCallError for a malformed call, and ValueError for an unknown syntax or tool."""
    offered = _offered(syntax, tools)
    if syntax == TAG_SYNTAX:
        return _parse_tag(text.rstrip(), offered)
    return _parse_json(text.rstrip(), offered)


def run_tool(call: ToolCall, *, timeout_s: float, max_output_chars: int = 500) -> ToolResult:
    """Run `call` and return what the model is told. Never raises. `timeout_s` bounds the python
    tool (the calculator is bounded by its own limits)."""
    t0 = time.monotonic()
    try:
        if not isinstance(call, ToolCall) or call.name not in TOOLS:
            raise ToolCallError(_unknown(getattr(call, "name", call), TOOLS))
        arg = _argument(call.name, call.arguments)
        if call.name == "calculator":
            text, error = _calculate(arg), False
        else:
            text, error = _python(arg, timeout_s, max_output_chars)
    except Exception as e:
        text, error = format_error(e), True
    return ToolResult(clip(text, max_output_chars), error, time.monotonic() - t0)


# --- parsing ---------------------------------------------------------------------------------

def _offered(syntax: str, tools: Iterable[str]) -> tuple[str, ...]:
    if syntax not in SYNTAXES:
        raise ValueError(f"unknown tool-call syntax {syntax!r}; the syntaxes are {', '.join(SYNTAXES)}")
    offered = tuple(tools)
    unknown = [t for t in offered if t not in TOOLS]
    if unknown or not offered:
        raise ValueError(f"tools must be some of {', '.join(TOOLS)}, got {list(offered)}")
    return offered


def _unknown(name, offered: Iterable[str]) -> str:
    return f"unknown tool {name!r}; the tools are {', '.join(offered)}"


def _parse_tag(text: str, offered: tuple[str, ...]) -> ToolCall | None:
    """`<calc>...</calc>` or `<python>...</python>` at the end of `text`. The tags of every tool
    are recognised, so that calling one that is not offered is an error rather than an answer."""
    for name, tag in TAG.items():
        opening, closing = f"<{tag}>", f"</{tag}>"
        if not text.endswith(closing):
            continue
        body = text[:-len(closing)]
        previous = body.rfind(closing)   # the call opens after the turn's previous call, if any
        start = body.find(opening, previous + len(closing) if previous >= 0 else 0)
        if start < 0:
            raise ToolCallError(f"'{closing}' without its opening '{opening}'")
        if name not in offered:
            raise ToolCallError(_unknown(name, offered))
        arg = body[start + len(opening):]
        arg = textwrap.dedent(arg).strip() if name == "python" else arg.strip()
        if not arg:
            raise ToolCallError(f"the {name} call is empty: write its {ARGUMENT[name]} between "
                                f"'{opening}' and '{closing}'")
        return ToolCall(name, {ARGUMENT[name]: arg})
    for tag in TAG.values():   # no call at the end: a tag elsewhere is a broken or misplaced call
        opening, closing = f"<{tag}>", f"</{tag}>"
        if text.rfind(opening) > text.rfind(closing):
            raise ToolCallError(f"'{opening}' without its closing '{closing}'")
        if closing in text and opening not in text[:text.find(closing)]:
            raise ToolCallError(f"'{closing}' without its opening '{opening}'")
        if closing in text:
            raise ToolCallError(f"text after '{closing}': a tool call must end the turn")
    return None


def _parse_json(text: str, offered: tuple[str, ...]) -> ToolCall | None:
    """The last `<tool_call>{...}</tool_call>` of `text`, which must end it."""
    start, end = text.rfind(JSON_OPEN), text.rfind(JSON_CLOSE)
    if start < 0 and end < 0:
        return None
    if start > end:
        raise ToolCallError(f"'{JSON_OPEN}' without its closing '{JSON_CLOSE}'")
    if start < 0:
        raise ToolCallError(f"'{JSON_CLOSE}' without its opening '{JSON_OPEN}'")
    if end + len(JSON_CLOSE) != len(text):
        raise ToolCallError(f"text after '{JSON_CLOSE}': a tool call must end the turn")
    call = _loads(text[start + len(JSON_OPEN):end], "tool call")
    if not isinstance(call, dict):
        raise ToolCallError(f'a tool call is a JSON object {{"name": ..., "arguments": {{...}}}}, '
                            f"got {_kind(call)}")
    extra = sorted(set(call) - {"name", "arguments"})
    if extra:
        raise ToolCallError(f'unexpected key {extra[0]!r} in the tool call: it takes "name" and "arguments"')
    name = call.get("name")
    if not isinstance(name, str):
        raise ToolCallError(f'the tool call needs "name" (a string), one of {", ".join(offered)}')
    if name not in offered:
        raise ToolCallError(_unknown(name, offered))
    arguments = call.get("arguments")
    if isinstance(arguments, str):   # some models encode the arguments as a JSON string
        arguments = _loads(arguments, '"arguments"')
    return ToolCall(name, {ARGUMENT[name]: _argument(name, arguments)})


def _loads(text: str, what: str):
    if _nesting(text) > MAX_NESTING:
        raise ToolCallError(f"{what} is nested more than {MAX_NESTING} levels deep")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"{what} is not valid JSON: {e.msg} at char {e.pos}") from None
    except RecursionError:
        raise ToolCallError(f"{what} is nested too deeply") from None


def _nesting(text: str) -> int:
    """How deep `[` and `{` nest in JSON `text`, outside strings (checked before parsing: the
    model's text must not be able to exhaust the parser's recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def _kind(value) -> str:
    """How a JSON value is named in a message ("an object", "a number", ...)."""
    return {dict: "an object", list: "a list", str: "a string", type(None): "null", bool: "a boolean",
            int: "a number", float: "a number"}.get(type(value), f"a {type(value).__name__}")


def _argument(name: str, arguments) -> str:
    """The one argument of tool `name` in `arguments` (an object holding exactly it, a string)."""
    key = ARGUMENT[name]
    needs = f"{name} needs the argument {key!r} (a string)"
    if not isinstance(arguments, dict):
        raise ToolCallError(f'{needs}: "arguments" must be an object, got {_kind(arguments)}')
    extra = sorted(str(k) for k in arguments if k != key)
    if extra:
        raise ToolCallError(f"{name} takes only the argument {key!r}, got {extra[0]!r}")
    value = arguments.get(key)
    if not isinstance(value, str):
        raise ToolCallError(needs if value is None else f"{needs}, got {_kind(value)}")
    if not value.strip():
        raise ToolCallError(f"{name}'s {key!r} is empty")
    return value


# --- the tools -------------------------------------------------------------------------------

def _python(code: str, timeout_s: float, max_output_chars: int) -> tuple[str, bool]:
    """The python tool: the snippet's output, stripped, then the error line if it failed."""
    r = run_snippet(code, timeout_s=timeout_s, max_output_chars=max_output_chars)
    output = r.output.strip()
    if r.status == "ok":
        return output or "(no output)", False
    err = format_error(r.error)
    if not output:
        return err, True
    # what it printed before failing, clipped so that the error line always fits
    return clip(output, max(0, max_output_chars - len(err) - 1)) + "\n" + err, True


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_TAKES = "numbers, + - * / // % ** and parentheses"
_REFUSED = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attributes",
            ast.Subscript: "subscripts", ast.Compare: "comparisons", ast.BoolOp: "and/or",
            ast.Lambda: "lambdas", ast.Tuple: "tuples", ast.List: "lists"}


def _calculate(expression: str) -> str:
    """Evaluate arithmetic `expression`; raises ValueError (or ZeroDivisionError) with the reason."""
    expression = expression.strip()
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression ({e.msg}); the calculator takes {_TAKES}") from None
    except (MemoryError, RecursionError):
        raise ValueError("the expression is nested too deeply") from None
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        raise ZeroDivisionError("division by zero") from None
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None
    except OverflowError:
        raise ValueError("the result is too large") from None
    return repr(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(_BINARY[type(node.op)](left, right))
    what = _REFUSED.get(type(node), f"{type(node).__name__} expressions")
    if isinstance(node, ast.Constant):
        what = f"{_kind(node.value)} constant"
    elif isinstance(node, ast.Name):
        what = f"names ({node.id!r})"
    raise ValueError(f"the calculator does not take {what}, only {_TAKES}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse an integer power whose result would have more than MAX_DIGITS digits, before it is
    computed (2**10**9 would hold the process for minutes)."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * math.log10(abs(base)) > MAX_DIGITS:
            raise ValueError(f"the result would have more than {MAX_DIGITS} digits")


def _checked(value):
    """`value` if it is a finite real number of at most MAX_DIGITS digits."""
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is too large")
    if isinstance(value, int) and abs(value).bit_length() > MAX_DIGITS * math.log2(10):
        raise ValueError(f"the result would have more than {MAX_DIGITS} digits")
    return value


# What a chat model is told about each tool: JSON schemas for templates that render `tools=`
# (Qwen2.5, Qwen3), and the same in words for templates that do not (SmolLM2)
SCHEMAS = {
    "calculator": {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression exactly "
        "(+ - * / // % ** and parentheses).",
        "parameters": {"type": "object", "required": ["expression"], "properties": {
            "expression": {"type": "string", "description": "e.g. 23+58*2"}}}}},
    "python": {"type": "function", "function": {
        "name": "python", "description": "Run Python code in a sandbox (no network, no files "
        "outside its directory, a time limit) and read what it prints.",
        "parameters": {"type": "object", "required": ["code"], "properties": {
            "code": {"type": "string", "description": "a Python program that prints its result"}}}}},
}


def instructions(tools: Iterable[str]) -> str:
    """The tools and the JSON call syntax in words, for a chat template that does not render
    `tools=` itself."""
    lines = [f"- {n}: {SCHEMAS[n]['function']['description']} Argument: \"{ARGUMENT[n]}\"."
             for n in tools]
    return ("You may call a tool. To call one, end your message with "
            f'{JSON_OPEN}{{"name": "TOOL", "arguments": {{"ARGUMENT": "VALUE"}}}}{JSON_CLOSE}; '
            "its result comes back in the next message. When you know the answer, give it "
            "without a tool call. Tools:\n" + "\n".join(lines))
