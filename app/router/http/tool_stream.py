"""OpenAI tool calling, the output side: a choice's text read as tool calls, whole or as it streams (pure: no
Ray, no FastAPI). The request side, and why the output has the shape it has, is tool_calls.py.

Two readers turn text into events — ("content", text), ("call", index, name, arguments so far) for a call's
first piece, ("args", index, more arguments) — and both are incremental, so a reply and a stream are the same
code: a whole reply is one feed. `HermesCalls` reads the model's own `<tool_call>{"name": ..., "arguments":
...}</tool_call>` blocks (tool_choice "auto"), as vLLM's hermes parser does: text outside the blocks is
content, a block whose JSON does not parse stays content, a call is emitted whole when its block closes.
`JsonCalls` reads the output a constrained call produced (tool_choice "required": an array of {"name",
"arguments"}; a named function: the arguments alone) and emits each call's arguments as they are generated.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from app.router.http.tool_calls import ToolPlan

OPEN, CLOSE = "<tool_call>", "</tool_call>"
Event = tuple


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class HermesCalls:
    """`<tool_call>` blocks in free text. Content's trailing whitespace is held back until text follows it, so
    the newlines around blocks do not become content; a reply with no calls keeps all of its text."""

    def __init__(self, parallel: bool = True):
        self.parallel, self.calls = parallel, 0
        self.buf, self.held, self.in_block = "", "", False

    def feed(self, text: str) -> list[Event]:
        ev: list[Event] = []
        self.buf += text
        while True:
            if not self.in_block:
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = _partial_suffix(self.buf, OPEN)
                    self._content(self.buf[: len(self.buf) - keep], ev)
                    self.buf = self.buf[len(self.buf) - keep :]
                    return ev
                self._content(self.buf[:i], ev)
                self.buf, self.in_block = self.buf[i + len(OPEN) :], True
            else:
                j = self.buf.find(CLOSE)
                if j < 0:
                    return ev
                body, self.buf, self.in_block = self.buf[:j], self.buf[j + len(CLOSE) :], False
                self._block(body, OPEN + body + CLOSE, ev)

    def finish(self) -> list[Event]:
        ev: list[Event] = []
        if self.in_block:  # cut off (max_tokens) or never closed: a call if its JSON is whole
            self._block(self.buf, OPEN + self.buf, ev)
        else:
            self._content(self.buf, ev)
        self.buf = ""
        if self.held and not self.calls:
            ev.append(("content", self.held))
        self.held = ""
        return ev

    def _content(self, text: str, ev: list[Event]) -> None:
        self.held += text
        body = self.held.rstrip()
        if body:
            ev.append(("content", body))
            self.held = self.held[len(body) :]

    def _block(self, body: str, raw: str, ev: list[Event]) -> None:
        call = _hermes_call(body)
        if call is None:
            self._content(raw, ev)
            return
        self.held = ""
        if self.calls and not self.parallel:
            return  # parallel_tool_calls false: the first call only (vLLM drops the rest too)
        ev.append(("call", self.calls, call[0], call[1]))
        self.calls += 1


def _hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a block's JSON, or None when it is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (it may be the start of one)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class JsonCalls:
    """A constrained call's JSON as it streams: `named` — the whole text is that function's arguments;
    otherwise an array of {"name": ..., "arguments": ...}, read by a character scanner that tracks strings and
    depth (the grammar guarantees the structure, and strings without raw control characters: see
    app/replica/grammar.py). Arguments seen before their call's name are held until it."""

    def __init__(self, named: str | None = None):
        self.named, self.calls = named, 0
        self.depth, self.in_str, self.esc = 0, False, False
        self.key: str | None = None
        self.s = ""  # the call-level string being read (a key, or the name)
        self.after_colon = self.args_pending = self.in_args = False
        self.index: int | None = None  # the current call's index once its name is known
        self.held = ""  # its arguments before that
        self.piece = ""  # its arguments since the last event

    def feed(self, text: str) -> list[Event]:
        if self.named is not None:
            if self.calls == 0:
                self.calls = 1
                return [("call", 0, self.named, text)]
            return [("args", 0, text)] if text else []
        ev: list[Event] = []
        for ch in text:
            self._char(ch, ev)
        self._flush(ev)
        return ev

    def finish(self) -> list[Event]:
        return self.feed("") if self.named is not None and self.calls == 0 else []

    def _char(self, ch: str, ev: list[Event]) -> None:
        level = 2  # a call's own keys sit at depth 2: [ {
        d, in_str, esc = self.depth, self.in_str, self.esc
        self._track(ch)
        if self.in_args and not in_str and d == level and ch in ",}":
            self.in_args = False
        elif self.args_pending and not ch.isspace():
            self.args_pending, self.in_args = False, True
        if self.in_args:
            if self.index is None:
                self.held += ch
            else:
                self.piece += ch
            return
        if in_str:
            if ch == '"' and not esc:
                self._string(ev)
            else:
                self.s += ch
        elif ch == '"':
            self.s = ""
        elif ch == "{" and self.depth == level:  # a call begins
            self.index, self.held, self.key, self.after_colon = None, "", None, False
        elif ch == "}" and d == level:  # it ends
            self._flush(ev)
            self.index = None
        elif ch == ":" and d == level:
            self.after_colon = True
            self.args_pending = self.key == "arguments"
        elif ch == "," and d == level:
            self.key, self.after_colon = None, False

    def _track(self, ch: str) -> None:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
        elif ch == '"':
            self.in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1

    def _string(self, ev: list[Event]) -> None:
        if self.depth != 2:
            return
        text = json.loads(f'"{self.s}"')
        if not self.after_colon:
            self.key = text
        elif self.key == "name" and self.index is None:
            self.index = self.calls
            self.calls += 1
            ev.append(("call", self.index, text, self.held))
            self.held = ""

    def _flush(self, ev: list[Event]) -> None:
        if self.piece and self.index is not None:
            ev.append(("args", self.index, self.piece))
        self.piece = ""


class ChoiceCalls:
    """One choice's output under a ToolPlan: OpenAI deltas as text arrives, or the whole reply's message."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.ids = plan, []
        self.reader: Any = (
            JsonCalls(plan.name if plan.choice == "named" else None)
            if plan.constrained
            else HermesCalls(plan.parallel)
        )

    @property
    def called(self) -> bool:
        return self.reader.calls > 0

    def deltas(self, text: str, done: bool) -> list[dict[str, Any]]:
        """OpenAI chat deltas for `text` (the choice's new output); `done`: its last."""
        events = self.reader.feed(text) + (self.reader.finish() if done else [])
        out: list[dict[str, Any]] = []
        for e in events:
            if e[0] == "content":
                out.append({"content": e[1]})
                continue
            if e[0] == "call":
                self.ids.append(new_call_id())
                fn = {"name": e[2], "arguments": e[3]}
                call = {"index": e[1], "id": self.ids[e[1]], "type": "function", "function": fn}
            else:
                call = {"index": e[1], "function": {"arguments": e[2]}}
            out.append({"tool_calls": [call]})
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The whole reply's assistant message (the same reading as a stream of it, reassembled)."""
        content, calls = "", []
        for d in self.deltas(text, True):
            content += d.get("content", "")
            for c in d.get("tool_calls", ()):
                if "id" in c:
                    calls.append({"id": c["id"], "type": "function", "function": dict(c["function"])})
                else:
                    calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
        if not calls:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content or None, "tool_calls": calls}

    def finish_reason(self, reason: str | None) -> str | None:
        """ "tool_calls" when the model stopped after calling (a named choice keeps "stop", as OpenAI's does)."""
        if reason == "stop" and self.called and self.plan.choice != "named":
            return "tool_calls"
        return reason


class ToolOutput:
    """A request's choices read for tool calls: stream chunks, or the reply body reshaped."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.choices: dict[int, ChoiceCalls] = {}

    def _choice(self, index: int) -> ChoiceCalls:
        if index not in self.choices:
            self.choices[index] = ChoiceCalls(self.plan)
        return self.choices[index]

    def chunks(self, base: dict, text: str, first: bool) -> list[dict]:
        """The stream chunks for one choice's delta: `base` is the chunk resp.stream_chunk made for it (its
        index, finish_reason and logprobs); its delta becomes the tool-call deltas, the logprobs ride on the
        first chunk, the finish_reason on the last."""
        choice = base["choices"][0]
        reader = self._choice(choice["index"])
        reason = choice["finish_reason"]
        deltas = reader.deltas(text, reason is not None)
        if not deltas:
            if not (first or reason is not None or choice["logprobs"]):
                return []  # text held back (a block not yet closed): nothing to say yet
            deltas = [{}]
        if first:
            deltas[0] = {"role": "assistant", **({"content": ""} if deltas[0] == {} else deltas[0])}
        out = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            c = {
                **choice,
                "delta": delta,
                "logprobs": choice["logprobs"] if k == 0 else None,
                "finish_reason": reader.finish_reason(reason) if last else None,
            }
            out.append({**base, "choices": [c]})
        return out

    def shape(self, body: dict) -> dict:
        """A whole chat reply (resp.completion_response's) with each choice's text read for tool calls."""
        for choice in body["choices"]:
            reader = self._choice(choice["index"])
            choice["message"] = reader.message(choice["message"]["content"])
            choice["finish_reason"] = reader.finish_reason(choice["finish_reason"])
        return body
