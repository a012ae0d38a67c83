"""Tool calling on chat completions, in the Hermes format small instruct models are tuned on.

The tools are described to the model in a system message; a call is a JSON object
`{"name": ..., "arguments": {...}}` inside `<tool_call>` tags. With tool_choice "required" or a
named function the output is constrained by a JSON schema of exactly that object, so the
arguments validate against the function's parameters; with "auto" the model decides and its
calls are parsed out of the text (`tool_call_parser`, incrementally when streamed). Earlier
assistant calls and tool results in the history are rendered in the same format, so they
reach the chat template instead of being dropped.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from producer_api.errors import ApiError
from producer_api.tool_call_parser import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ParsedCall,
    ToolCallEvent,
    ToolCallParser,
    parse_whole,
)
from schemas import ErrorCode

MAX_TOOLS = 128


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, JsonValue] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """An assistant message's earlier call, as clients send it back in the history."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolPlan(BaseModel):
    """What the request's tools and tool_choice mean for one generation."""

    tools: list[Tool]
    mode: Literal["auto", "forced"]  # forced: required or a named function
    forced_names: list[str] = Field(default_factory=list)


def plan_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolPlan | None:
    """None when no tool may be called (no tools, or tool_choice "none")."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise _invalid("tool_choice", "tool_choice needs tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise _invalid("tools", f"at most {MAX_TOOLS} tools")
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        return ToolPlan(tools=tools, mode="auto")
    if choice == "required":
        return ToolPlan(tools=tools, mode="forced", forced_names=[t.function.name for t in tools])
    assert isinstance(choice, NamedToolChoice)
    names = {t.function.name for t in tools}
    if choice.function.name not in names:
        raise _invalid("tool_choice", f"no tool named {choice.function.name!r} in tools")
    return ToolPlan(tools=tools, mode="forced", forced_names=[choice.function.name])


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(ErrorCode.INVALID_REQUEST, f"{param}: {message}", param)


def _parameters(tool: Tool) -> dict[str, JsonValue]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def forced_call_schema(plan: ToolPlan) -> dict[str, Any]:
    """JSON schema of one call to one of the forced functions, arguments included."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in plan.tools
        if t.function.name in plan.forced_names
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tools_system_prompt(plan: ToolPlan) -> str:
    signatures = [t.model_dump(exclude_none=True) for t in plan.tools]
    return (
        "You are a function calling AI model. You are provided with function signatures "
        "within <tools></tools> XML tags. You may call one or more functions to assist with "
        "the user query. Don't make assumptions about what values to plug into functions.\n"
        f"<tools>\n{json.dumps(signatures)}\n</tools>\n"
        "For each function call return a JSON object with the function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def render_tool_calls(content: str, calls: list[ToolCallIn]) -> str:
    """An assistant turn's text with its earlier calls in the format the model emits."""
    parts = [content] if content else []
    for call in calls:
        try:
            arguments: JsonValue = json.loads(call.function.arguments)
        except ValueError:
            arguments = call.function.arguments
        body = json.dumps({"name": call.function.name, "arguments": arguments})
        parts.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(parts)


def render_tool_result(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def tool_call_parser(plan: ToolPlan) -> ToolCallParser:
    """A parser of the calls the plan allows, for one streamed choice."""
    return ToolCallParser(_callable_names(plan), forced=plan.mode == "forced")


def _callable_names(plan: ToolPlan) -> set[str]:
    if plan.mode == "forced":
        return set(plan.forced_names)
    return {t.function.name for t in plan.tools}


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a whole generated text, as its stream would give them; without
    calls the content is the text (trimmed), with calls None when there is none besides."""
    content, calls = parse_whole(text, _callable_names(plan), forced=plan.mode == "forced")
    if not calls:
        return content, []
    return content or None, calls


def tool_calls_body(calls: list[ParsedCall], call_id_prefix: str) -> list[dict[str, Any]]:
    return [
        {
            "id": f"{call_id_prefix}-{index}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for index, call in enumerate(calls)
    ]


def tool_call_delta(events: list[ToolCallEvent], call_id_prefix: str) -> dict[str, Any]:
    """A stream delta of parser events: content, and `tool_calls` entries whose first one per
    call carries id, type and name, the later ones fragments of the arguments."""
    delta: dict[str, Any] = {}
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    if content:
        delta["content"] = content
    entries: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, CallStart):
            entries.append(
                {
                    "index": event.index,
                    "id": f"{call_id_prefix}-{event.index}",
                    "type": "function",
                    "function": {"name": event.name, "arguments": ""},
                }
            )
        elif isinstance(event, ArgumentsDelta):
            if entries and entries[-1]["index"] == event.index:
                entries[-1]["function"]["arguments"] += event.text
            else:
                entries.append({"index": event.index, "function": {"arguments": event.text}})
    if entries:
        delta["tool_calls"] = entries
    return delta
