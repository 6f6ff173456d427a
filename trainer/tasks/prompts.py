"""How a problem becomes the prompt text the engine tokenizes: the one place prompts are rendered.

A problem's prompt is a string, or (JSONL rows) a list of chat messages
`[{"role": "system" | "user" | "assistant", "content": "..."}, ...]` ending with a user message.
Rendering, with `data.prompt_template`, `data.system_prompt` and `data.chat_template`:

1. `data.prompt_template` is applied to the problem text (a string prompt) or to the content of
   the last user message: '{prompt}' is replaced by it (str.replace: braces in problems are safe).
2. `data.system_prompt` (when not empty) becomes a leading system message, unless the messages
   already start with one (the row's own system message wins).
3. `data.chat_template = "auto"` and the tokenizer has a chat template: the messages go through
   `tokenizer.apply_chat_template(..., add_generation_prompt=True)`, so the text ends where the
   assistant's answer starts. A leading BOS token the template writes is dropped from the text
   when the tokenizer adds one itself when it tokenizes, so the prompt carries exactly one.
   In multi-turn runs that offer tools (`episode.tools`, trainer/episode/) the template is given
   their JSON schemas (`tools=`); a template that ignores them gets them in words in the system
   message instead (`trainer.episode.tools.instructions`), so the model always knows the call
   syntax. The plain format below describes no tools: the built-in model learnt its tags.
4. Otherwise (`"none"`, or a tokenizer without a chat template) the prompt is plain text: the
   system prompt, a blank line, then the templated problem text. Messages become a transcript,
   one block per message ("System: ...", "User: ...", "Assistant: ..."), ending with
   "Assistant:".

The rendered text is `Problem.prompt`: what the rollout inspector and the reports show, and what
`trainer.rollout.base.new_group` tokenizes.
"""
from __future__ import annotations

from typing import Any

from trainer.config import short_repr

CHAT_TEMPLATE_CHOICES = ("auto", "none")
ROLES = ("system", "user", "assistant")
_PLAIN_ROLE = {"system": "System", "user": "User", "assistant": "Assistant"}


def messages_problem(value: Any) -> str | None:
    """Why `value` is not a valid list of chat messages (None when it is). Messages are
    {"role", "content"} objects (other fields are ignored), roles among system/user/assistant,
    contents non-empty strings, a system message only first, and the last message from the user."""
    if not isinstance(value, list):
        return f"expected a list of messages, got {type(value).__name__}"
    if not value:
        return "the list of messages is empty"
    for i, m in enumerate(value):
        where = f"message {i}"
        if not isinstance(m, dict):
            return f"{where}: expected an object {{\"role\": ..., \"content\": ...}}, got {type(m).__name__}"
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            return f"{where}: 'role' must be one of {', '.join(map(repr, ROLES))}, got {short_repr(role)}"
        if not isinstance(content, str):
            return f"{where}: 'content' must be a string, got {type(content).__name__}"
        if not content.strip():
            return f"{where}: 'content' is empty"
        if role == "system" and i != 0:
            return f"{where}: a 'system' message may only come first"
    if value[-1]["role"] != "user":
        return f"the last message must have role 'user' (the model answers it), got {value[-1]['role']!r}"
    return None


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) if tokenizer is not None else False


class PromptRenderer:
    """Renders problem prompts (a string or chat messages) to the text the engine tokenizes."""

    def __init__(self, tokenizer=None, template: str = "{prompt}", chat_template: str = "auto",
                 system_prompt: str = "", tools: tuple[str, ...] = ()):
        if chat_template not in CHAT_TEMPLATE_CHOICES:
            raise ValueError(f"data.chat_template: got {chat_template!r}; expected one of "
                             + ", ".join(map(repr, CHAT_TEMPLATE_CHOICES)))
        self.tokenizer = tokenizer
        self.template = template
        self.system_prompt = system_prompt
        self.uses_chat = chat_template == "auto" and has_chat_template(tokenizer)
        self._strip_bos = self.uses_chat and _adds_bos(tokenizer)
        self.tools = tuple(tools)

    @classmethod
    def from_config(cls, cfg, tokenizer=None) -> "PromptRenderer":
        from trainer.episode.environments import offered_tools

        d = cfg.data
        return cls(tokenizer, template=d.prompt_template, chat_template=d.chat_template,
                   system_prompt=d.system_prompt, tools=offered_tools(cfg) or ())

    def messages(self, prompt: str | list[dict]) -> list[dict]:
        """The conversation a prompt stands for: the template applied to the (last) user turn,
        the system prompt in front when there is no system message."""
        if isinstance(prompt, str):
            msgs = [{"role": "user", "content": self._apply(prompt)}]
        else:
            problem = messages_problem(prompt)
            if problem:
                raise ValueError(problem)
            msgs = [{"role": m["role"], "content": m["content"]} for m in prompt]  # others ignored
            msgs[-1]["content"] = self._apply(msgs[-1]["content"])
        if self.system_prompt and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def render(self, prompt: str | list[dict], tools: tuple[str, ...] | None = None) -> str:
        """The prompt text (see the module docstring); `tools`: the problem's own, instead of
        the run's (a JSONL row's "tools")."""
        msgs = self.messages(prompt)
        if self.uses_chat:
            text = self._chat(msgs, self.tools if tools is None or not self.tools else tools)
            bos = self.tokenizer.bos_token
            if self._strip_bos and bos and text.startswith(bos):
                text = text[len(bos):]
            return text
        if isinstance(prompt, str):
            user = msgs[-1]["content"]
            return f"{msgs[0]['content']}\n\n{user}" if msgs[0]["role"] == "system" else user
        blocks = [f"{_PLAIN_ROLE[m['role']]}: {m['content']}" for m in msgs]
        return "\n\n".join(blocks) + "\n\nAssistant:"

    def _chat(self, msgs: list[dict], tools: tuple[str, ...]) -> str:
        """The chat template's text, with the offered tools (see the module docstring)."""
        render = self.tokenizer.apply_chat_template
        plain = render(msgs, tokenize=False, add_generation_prompt=True)
        if not tools:
            return plain
        from trainer.episode.tools import SCHEMAS, instructions

        schemas = [SCHEMAS[n] for n in tools]
        with_tools = render(msgs, tools=schemas, tokenize=False, add_generation_prompt=True)
        if with_tools != plain:
            return with_tools
        note = instructions(tools)
        if msgs[0]["role"] == "system":
            msgs = [{"role": "system", "content": msgs[0]["content"] + "\n\n" + note}] + msgs[1:]
        else:
            msgs = [{"role": "system", "content": note}] + msgs
        return render(msgs, tokenize=False, add_generation_prompt=True)

    def _apply(self, text: str) -> str:
        return self.template.replace("{prompt}", text)


def _adds_bos(tokenizer) -> bool:
    """Does tokenizing text put the BOS token in front by itself?"""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    try:
        ids = tokenizer("a").input_ids
    except Exception:
        return False
    return bool(ids) and ids[0] == bos
