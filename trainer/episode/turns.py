"""How an environment's turn is written into the conversation, after the model's turn.

Two formats, picked by the tokenizer (the same choice as prompts: `data.chat_template`):

- chat: the model's own chat template renders the environment's message, a tool result with the
  template's "tool" role, feedback as a "user" message, then opens the next assistant turn. The
  text is taken from the template itself: a conversation with sentinel contents is rendered, and
  what stands between the assistant's content and the tool's (and after it) is the wrapper; so
  whatever the template writes (ChatML's `<|im_end|>\\n<|im_start|>tool\\n`, Qwen's
  `<tool_response>`) is what the model reads, with no per-model table. Calls are written in the
  JSON syntax (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Hermes/Qwen).
  When the model's turn already ends with the token that starts that wrapper (its end-of-turn
  token, which the engine keeps in the response), it is not written twice.
- plain (the built-in character-level model, or a tokenizer without a chat template): a tool
  result is `<result>TEXT</result>`, feedback `<feedback>TEXT</feedback>`, and calls use the tag
  syntax (`<calc>23+58</calc>`), right after the model's text.
"""
from __future__ import annotations

from trainer.episode.tools import JSON_SYNTAX, TAG_SYNTAX, clip_words

TOOL, FEEDBACK = "tool", "feedback"   # who speaks in an environment turn
_SENTINEL = {"user": "\u2063USER\u2063", "assistant": "\u2063MODEL\u2063", TOOL: "\u2063ENV\u2063"}


def plain_text(content: str) -> str:
    """`content` as text any tokenizer takes: a lone surrogate (a tool printed chr(0xD800)) is
    not UTF-8 and would stop the tokenizer, so it becomes '?'."""
    return content.encode("utf-8", "replace").decode("utf-8")


class TurnFormat:
    """Writes environment turns for one tokenizer; `syntax` is the tool-call syntax its model
    uses (trainer/episode/tools.py)."""

    def __init__(self, tokenizer, *, chat: bool):
        self.tokenizer = tokenizer
        self.chat = chat
        self.syntax = JSON_SYNTAX if chat else TAG_SYNTAX
        self._wrappers = {role: self._template_wrapper(role) for role in (TOOL, FEEDBACK)} if chat else {}

    @classmethod
    def for_renderer(cls, renderer) -> "TurnFormat":
        """The format that matches how prompts are rendered (`PromptRenderer.uses_chat`)."""
        return cls(renderer.tokenizer, chat=renderer.uses_chat)

    def env_text(self, role: str, content: str, last_id: int | None = None) -> str:
        """The text appended after a model turn for an environment message from `role` (TOOL or
        FEEDBACK) saying `content`; `last_id` is the turn's last token: when it is a special
        token the wrapper starts with (the model's own end of turn), it is not written twice."""
        before, after = self._around(role, last_id)
        return before + plain_text(content) + after

    def env_ids(self, role: str, content: str, last_id: int | None = None) -> list[int]:
        """`env_text` as token ids (no special tokens added around it). The wrapper is the
        template's, special tokens and all; the content is plain text: a special token's string
        inside it ("<|im_start|>assistant", the eos text) is tokenized as the characters it is
        made of, so an environment cannot forge a turn."""
        before, after = self._around(role, last_id)
        tok = self.tokenizer
        ids = list(tok(before, add_special_tokens=False).input_ids) if before else []
        ids += tok(plain_text(content), add_special_tokens=False, split_special_tokens=True).input_ids
        if after:
            ids += tok(after, add_special_tokens=False).input_ids
        return ids

    def env_ids_within(self, role: str, content: str, last_id: int | None,
                       room: int) -> tuple[list[int], bool]:
        """`env_ids` in at most `room` tokens, and whether the message is whole. Too long: its
        content cut after a whole word and marked (tools.clip_words), the longest cut whose
        message, wrapper included, fits; not even the wrapper and the mark fit: no tokens (a
        message is never cut inside its wrapper, nor without a mark)."""
        ids = self.env_ids(role, content, last_id)
        if len(ids) <= room:
            return ids, True
        best: list[int] = []
        lo, hi = 0, len(content) - 1
        while lo <= hi:   # the longest cut that fits: its length grows with the characters kept
            mid = (lo + hi) // 2
            cut = self.env_ids(role, clip_words(content, mid), last_id)
            if len(cut) <= room:
                best, lo = cut, mid + 1
            else:
                hi = mid - 1
        return best, False

    def _around(self, role: str, last_id: int | None) -> tuple[str, str]:
        if not self.chat:
            tag = "result" if role == TOOL else "feedback"
            return f"<{tag}>", f"</{tag}>"
        before, after = self._wrappers[role]
        if last_id is not None and last_id in set(self.tokenizer.all_special_ids):
            ended = self.tokenizer.decode([last_id], skip_special_tokens=False)
            if ended and before.startswith(ended):
                before = before[len(ended):]
        return before, after

    def _template_wrapper(self, role: str) -> tuple[str, str]:
        """(before, after) the environment's content, from the chat template."""
        tok = self.tokenizer
        who = "tool" if role == TOOL else "user"
        base = [{"role": "user", "content": _SENTINEL["user"]},
                {"role": "assistant", "content": _SENTINEL["assistant"]}]
        text = tok.apply_chat_template(base + [{"role": who, "content": _SENTINEL[TOOL]}],
                                       tokenize=False, add_generation_prompt=True)
        if _SENTINEL["assistant"] not in text or _SENTINEL[TOOL] not in text:
            raise ValueError(f"the tokenizer's chat template does not render a {who!r} message "
                             "after an assistant turn; set data.chat_template = 'none' to use the "
                             "plain format")
        tail = text.split(_SENTINEL["assistant"], 1)[1]
        before, after = tail.split(_SENTINEL[TOOL], 1)
        return before, after
