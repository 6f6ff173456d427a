"""Chat requests as engine tokens, and the engine's tokens as chat responses.

An agent's episode is one token sequence, never re-tokenised from text:

    prompt    render(messages₁, tools)                  the chat template, once (first call)
    model     completion₁                               the engine's tokens, as generated
    env       delta(messages₂ after messages₁ + reply₁)  the new messages only (tool results,
    model     completion₂                                 user turns), in the template's words
    ...

A later call's messages must extend the conversation so far: the same messages, then the reply
this endpoint gave (its text, or its tool calls), then new messages of roles `tool` or `user`.
Only those new messages are rendered (`ChatFormat.delta_ids`) and appended as environment tokens
(never trained); the model's earlier turns stay the tokens it generated.

Two formats, the ones the trainer's episodes use (trainer/episode/turns.py):

- chat (a tokenizer with a chat template): the first prompt is `apply_chat_template(messages,
  tools=..., add_generation_prompt=True)`; the delta is what the template writes after an
  assistant turn for the new messages, read off the template with sentinel contents (so no
  per-model table), each content tokenized as plain text (a special token's string inside a tool
  result is its characters: it cannot forge a turn). Tool calls are parsed from the Hermes/Qwen
  syntax `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, for the request's tools.
- plain (the built-in character-level models): a single user message is the prompt as is (a
  conversation becomes a transcript, trainer/tasks/prompts.py); a tool result is appended as
  `<result>TEXT</result>`, a user message as `<feedback>TEXT</feedback>`. Calls are the tag
  syntax the built-in tools model learnt (`<calc>23+58</calc>`), reported as a call of the
  request's function `calculator` (argument `expression`) or `python` (argument `code`).

`AgentError(status, message)` is a refusal with the HTTP status to answer it with.
"""
from __future__ import annotations

import json
import re
from typing import Any

from trainer.episode.tools import (
    JSON_CLOSE,
    JSON_OPEN,
    TAG,
    TAG_SYNTAX,
    TOOLS,
    ToolCallError,
    parse_call,
)
from trainer.episode.turns import FEEDBACK, TOOL, TurnFormat
from trainer.tasks.prompts import PromptRenderer

NEW_ROLES = ("tool", "user")   # what may follow the model's reply in a later call
_SENT = "\u2063{}\u2063"


class AgentError(Exception):
    """A request refused: `status` is the HTTP status, the message says what is wrong."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, None (an assistant's that only calls tools), or a
    list of text parts ({"type": "text", "text": ...})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise AgentError(400, f"{where}: only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise AgentError(400, f"{where}: 'content' must be a string or a list of text parts")


def normal(message: Any, i: int) -> dict:
    """A message as compared between calls: role, text, and the calls it made (name, arguments
    as parsed JSON)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise AgentError(400, f"{where}: expected an object with 'role' and 'content'")
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise AgentError(400, f"{where}: unknown role {role!r}")
    calls = []
    for c in message.get("tool_calls") or []:
        fn = (c or {}).get("function") or {}
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        calls.append([fn.get("name"), args])
    return {"role": "system" if role == "developer" else role,
            "content": text_of(message.get("content"), where), "tool_calls": calls}


def tool_names(tools: Any) -> list[str]:
    """The function names a request offers (`tools`: OpenAI's [{"type": "function", "function":
    {"name": ..., ...}}])."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise AgentError(400, "'tools' must be a list")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise AgentError(400, f"tools[{i}]: expected {{'type': 'function', 'function': "
                                  "{'name': ..., 'parameters': {...}}}")
        names.append(fn["name"])
    return names


class ChatFormat:
    """Renders one tokenizer's chat requests (see the module docstring)."""

    def __init__(self, tokenizer, *, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.turns = TurnFormat(tokenizer, chat=chat)
        self.plain = PromptRenderer(tokenizer, chat_template="none")

    @classmethod
    def for_config(cls, cfg, tokenizer) -> "ChatFormat":
        return cls(tokenizer, chat=PromptRenderer.from_config(cfg, tokenizer).uses_chat)

    # --- requests -> tokens ---------------------------------------------------------------------
    def prompt_ids(self, messages: list[dict], tools: list | None) -> list[int]:
        """The first call's prompt: the whole conversation, rendered once."""
        msgs = [normal(m, i) for i, m in enumerate(messages)]
        if not msgs or msgs[-1]["role"] not in NEW_ROLES:
            raise AgentError(400, "the last message must be from the user (or a tool): the model "
                                  "answers it")
        if self.chat:
            kwargs = {"tools": tools} if tools else {}
            text = self.tokenizer.apply_chat_template(
                [_for_template(m) for m in msgs], tokenize=False, add_generation_prompt=True,
                **kwargs)
        elif len(msgs) == 1 or (len(msgs) == 2 and msgs[0]["role"] == "system"):
            text = self.plain.render(msgs[-1]["content"]) if len(msgs) == 1 else \
                f"{msgs[0]['content']}\n\n{msgs[1]['content']}"
        else:
            try:
                text = self.plain.render([{"role": m["role"], "content": m["content"]} for m in msgs])
            except ValueError as e:
                raise AgentError(400, f"the built-in model's plain format: {e}") from None
        ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        if not ids:
            raise AgentError(400, "the prompt is empty")
        return ids

    def delta_ids(self, new: list[dict], last_id: int | None) -> tuple[list[int], int]:
        """The tokens of the messages that follow the model's reply (`new`, normalised, roles
        tool or user), ending where the model's next turn starts; and how many are user turns.
        `last_id`: the reply's last token (a special end-of-turn token is not written twice)."""
        users = sum(1 for m in new if m["role"] == "user")
        if not self.chat:
            ids: list[int] = []
            for m in new:
                ids += self.turns.env_ids(TOOL if m["role"] == "tool" else FEEDBACK, m["content"])
            return ids, users
        tok = self.tokenizer
        marks = [_SENT.format(f"C{i}") for i in range(len(new))]
        base = [{"role": "user", "content": _SENT.format("U")},
                {"role": "assistant", "content": _SENT.format("A")}]
        rest = [{**_for_template(m), "content": mark} for m, mark in zip(new, marks)]
        text = tok.apply_chat_template(base + rest, tokenize=False, add_generation_prompt=True)
        if _SENT.format("A") not in text or any(mk not in text for mk in marks):
            raise AgentError(400, "the model's chat template does not render these messages "
                                  "after an assistant turn")
        tail = text.split(_SENT.format("A"), 1)[1]
        if last_id is not None and last_id in set(tok.all_special_ids):
            ended = tok.decode([last_id], skip_special_tokens=False)
            if ended and tail.startswith(ended):
                tail = tail[len(ended):]
        ids = []
        for mark, m in zip(marks, new):
            wrapper, tail = tail.split(mark, 1)
            ids += tok(wrapper, add_special_tokens=False).input_ids if wrapper else []
            ids += tok(m["content"], add_special_tokens=False, split_special_tokens=True).input_ids
        ids += tok(tail, add_special_tokens=False).input_ids if tail else []
        return list(ids), users

    # --- tokens -> a response -------------------------------------------------------------------
    def reply(self, completion_ids: list[int], offered: list[str], call_prefix: str) -> dict:
        """The assistant's message for a completion: {"role", "content", "tool_calls"} (calls
        of the request's functions only; anything else stays text)."""
        text = self.tokenizer.decode(completion_ids, skip_special_tokens=True)
        calls: list[tuple[str, dict]] = []
        content = text
        if offered and self.chat:
            content, calls = _json_calls(text, offered)
        elif offered:
            builtin = [n for n in offered if n in TOOLS]
            try:
                call = parse_call(text, TAG_SYNTAX, builtin) if builtin else None
            except (ToolCallError, ValueError):
                call = None
            if call is not None:
                content = text[:text.rfind(f"<{TAG[call.name]}>")]
                calls = [(call.name, call.arguments)]
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            msg["tool_calls"] = [{"id": f"{call_prefix}_{k}", "type": "function",
                                  "function": {"name": n, "arguments": json.dumps(a)}}
                                 for k, (n, a) in enumerate(calls)]
        return msg


def _for_template(m: dict) -> dict:
    out = {"role": m["role"], "content": m["content"]}
    if m["tool_calls"]:
        out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}}
                             for n, a in m["tool_calls"]]
    return out


_CALL = re.compile(re.escape(JSON_OPEN) + r"(.*?)" + re.escape(JSON_CLOSE), re.S)


def _json_calls(text: str, offered: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    """The text before the first call, and every well-formed call of an offered function."""
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or call.get("name") not in offered:
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                continue
        if isinstance(args, dict):
            calls.append((call["name"], args))
    if not calls:
        return text, []
    return text[:text.find(JSON_OPEN)].strip(), calls
