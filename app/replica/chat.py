"""A chat's prompt: the tokenizer's chat template, or a plain transcript for a tokenizer without one (a model
that is no chat model: tools are not described to it).

A template that knows tools (it reads the `tools` variable: Qwen2.5, Llama 3.1, Hermes...) gets them as they
are. One that does not (SmolLM2's, Gemma's) would drop them silently, so the tools go into the
system message in the Hermes format that tool_choice "auto" parses back (app/router/http/tool_stream.py): the
function signatures in `<tools>`, and the instruction to answer `<tool_call>{"name", "arguments"}</tool_call>`.
A past call in such a chat is written the same way in its assistant turn, and a tool's result becomes a user
turn in `<tool_response>` (templates without tools usually accept only system/user/assistant; the results of
parallel calls share one turn, for templates that insist on alternating roles)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

TOOLS_SYSTEM = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>{{"name": <function-name>, "arguments": '
    "<args-json-object>}}</tool_call>"
)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any = None,
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text for `messages` (OpenAI's role/content dicts); `tools` (OpenAI's tool objects) go to the
    template if it reads them, else into the system message (see the module's docstring)."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    msgs = [dict(m) for m in messages]
    extra: dict[str, Any] = {}
    if not template:
        lines = [f"{m['role']}: {m['content']}" for m in msgs]
        return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
    if tools and knows_tools(template):
        extra["tools"] = [dict(t) for t in tools]
    elif tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in msgs):
        msgs = hermes_messages(msgs, tools or ())
    return tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )


def knows_tools(template: Any) -> bool:
    """Whether a chat template renders tools itself (it names the `tools` variable; a dict of named templates
    counts if any does)."""
    if isinstance(template, Mapping):
        return any(knows_tools(t) for t in template.values())
    if isinstance(template, list):  # transformers' list form: [{"name", "template"}]
        return any(knows_tools(t.get("template")) for t in template if isinstance(t, Mapping))
    return isinstance(template, str) and "tools" in template


def hermes_messages(
    messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """`messages` for a template without tools: the tools in the system message, past calls as `<tool_call>`
    text, tool results as user turns in `<tool_response>`."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.get("role") == "tool":
            text = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if i and messages[i - 1].get("role") == "tool":  # results of parallel calls: one user turn
                out[-1]["content"] += "\n" + text
                continue
            m = {"role": "user", "content": text}
        elif m.get("tool_calls"):
            calls = [_call_text(c) for c in m["tool_calls"]]
            m = {"role": m["role"], "content": "\n".join(filter(None, [m.get("content"), *calls]))}
        out.append(m)
    if tools:
        text = TOOLS_SYSTEM.format(tools="\n".join(json.dumps(dict(t), ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _call_text(call: Mapping[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):  # JSON text as OpenAI sends it (chat_messages parses it where it can)
        try:
            args = json.loads(args) if args else {}
        except ValueError:
            pass
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"<tool_call>{body}</tool_call>"
