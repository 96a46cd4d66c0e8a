"""OpenAI tool calling, the request side: `tools`, `tool_choice`, `parallel_tool_calls` and the messages that
carry calls (an assistant's `tool_calls`, a `tool` message's result) checked into a `ToolPlan`, with 400s naming
the field (pure: no Ray, no FastAPI).

`tool_choice` "required" or a named function is grammar-constrained through the response_format machinery
(app/replica/grammar.py): `ToolPlan.constraint` is the JSON schema the output must match, so a call's arguments
always parse and validate against its function's schema. "required": an array of {"name": const, "arguments":
that function's parameters} (at most one item when parallel_tool_calls is false); a named function: its
arguments object alone. The schema keeps "name" before "arguments" (xgrammar emits properties in schema order),
so a stream can name a call before its arguments arrive. "auto" parses the model's own Hermes-style
`<tool_call>` blocks; "none" parses nothing. Either way the chat template is given the tools. The output side
(parsing, stream deltas, reply shaping) is tool_stream.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from app.protocol import ToolFunction
from app.router.http.openai_requests import ChatRequest, clip, invalid, messages_of
from app.router.http.openai_sampling import MAX_SCHEMA_CHARS

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_NO_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: omitting `parameters` means an empty list


@dataclass(frozen=True)
class ToolPlan:
    """A chat's tools and what to do with them: `choice` is "auto", "none", "required" or "named" (`name`)."""

    tools: tuple[ToolFunction, ...]
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the output is read for tool calls (not for "none")."""
        return self.choice != "none"

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def constraint(self) -> str | None:
        """The JSON schema (as JSON text, properties in order) the output must match, or None (free text)."""
        if not self.constrained:
            return None
        params = {t.name: json.loads(t.parameters) if t.parameters else _NO_PARAMETERS for t in self.tools}
        if self.choice == "named":
            schema: dict[str, Any] = params[self.name]  # type: ignore[index]
        else:
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": p},
                    "required": ["name", "arguments"],
                }
                for name, p in params.items()
            ]
            schema = {
                "type": "array",
                "minItems": 1,
                "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
            }
            if not self.parallel:
                schema["maxItems"] = 1
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        if len(text) > MAX_SCHEMA_CHARS:
            raise invalid("tools", f"the call's schema is {len(text)} characters; at most {MAX_SCHEMA_CHARS}")
        return text


def plan_of(req: ChatRequest) -> ToolPlan | None:
    """The request's tool plan (None when it gives no tools), or a 400 naming the field at fault. Also checks
    the messages that carry tool calls and results."""
    _check_messages(req)
    tools, choice = req.tools, req.tool_choice
    if tools is None:
        if choice is not None and choice != "none":
            raise invalid("tool_choice", "is only allowed when tools are given")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid("tools", f"must be a list of at most {MAX_TOOLS} tools")
    functions = tuple(_tool(i, t) for i, t in enumerate(tools))
    names = [f.name for f in functions]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise invalid("tools", f"two tools are named {dup!r}; names must be unique")
    if not functions:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice", "needs at least one tool")
        return None
    parallel = req.parallel_tool_calls is not False
    if choice is None or choice in ("auto", "none", "required"):
        return ToolPlan(functions, choice or "auto", None, parallel)
    if isinstance(choice, str):
        raise invalid(
            "tool_choice", f'must be "none", "auto", "required" or a function, got {clip(choice)!r}'
        )
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict):
        raise invalid("tool_choice", 'a named choice is {"type": "function", "function": {"name": ...}}')
    name = fn.get("name")
    if not isinstance(name, str) or name not in names:
        shown = clip(name) if isinstance(name, str) else name
        raise invalid("tool_choice", f"names no tool in tools: {shown!r} (tools: {', '.join(names)[:200]})")
    return ToolPlan(functions, "named", name, parallel)


def check_constraint(req: ChatRequest, plan: ToolPlan | None) -> None:
    """A constrained call owns the output's grammar: no response_format, and it must be able to end."""
    if plan is None or not plan.constrained:
        return
    rf = req.response_format
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        raise invalid("tool_choice", "a required or named tool call cannot be combined with response_format")
    if req.ignore_eos:
        raise invalid("tool_choice", "a required or named tool call cannot be combined with ignore_eos")


def _tool(i: int, tool: Any) -> ToolFunction:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid(f"{where}.type", 'each tool must be {"type": "function", "function": {...}}')
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise invalid(f"{where}.function", 'must be an object {"name", "description", "parameters"}')
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(f"{where}.function.name", "must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{where}.function.description", "must be a string")
    params = fn.get("parameters")
    if params is None:
        return ToolFunction(name, description, None)
    if not isinstance(params, dict):
        raise invalid(f"{where}.function.parameters", "must be a JSON schema (an object)")
    _check_schema(f"{where}.function.parameters", params)
    return ToolFunction(name, description, json.dumps(params, separators=(",", ":"), ensure_ascii=False))


def _check_schema(param: str, schema: dict) -> None:
    try:
        import jsonschema
    except ImportError:  # Ray brings jsonschema along; without it the replica's compile still refuses junk
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise invalid(param, f"not a valid JSON schema: {str(e.message)[:200]}") from None


def _check_messages(req: ChatRequest) -> None:
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if m.role == "tool" and (not isinstance(m.tool_call_id, str) or not m.tool_call_id):
            raise invalid(
                f"{where}.tool_call_id", "a tool message needs the tool_call_id of the call it answers"
            )
        if m.tool_calls is None:
            continue
        if m.role != "assistant":
            raise invalid(f"{where}.tool_calls", "only assistant messages carry tool_calls")
        if not isinstance(m.tool_calls, list):
            raise invalid(f"{where}.tool_calls", "must be a list of tool calls")
        for j, call in enumerate(m.tool_calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise invalid(
                    f"{where}.tool_calls[{j}]",
                    'each call is {"id", "type": "function", "function": {"name", "arguments"}}',
                )
            if not isinstance(fn.get("arguments", ""), str):
                raise invalid(f"{where}.tool_calls[{j}].function.arguments", "must be a string (JSON text)")


def chat_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """The messages as the replica's chat template gets them: role and content, an assistant's tool_calls
    (arguments parsed back into objects where they are JSON, as templates print them with tojson) and a tool
    message's tool_call_id (and name)."""
    out = messages_of(req)
    for m, msg in zip(req.messages, out):
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
            if isinstance(m.name, str):
                msg["name"] = m.name
    return out


def _template_call(call: dict) -> dict[str, Any]:
    fn = call["function"]
    args: Any = fn.get("arguments", "")
    try:
        args = json.loads(args) if args else {}
    except ValueError:
        pass  # not JSON: the template gets the text as the caller sent it
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
