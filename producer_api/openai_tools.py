"""Tool calling on chat completions, in the Hermes format small instruct models are tuned on.

The tools are described to the model in a system message; a call is a JSON object
`{"name": ..., "arguments": {...}}` inside `<tool_call>` tags. With tool_choice "required" or a
named function the output is constrained by a JSON schema of exactly that object, so the
arguments validate against the function's parameters; with "auto" the model decides and its
calls are parsed out of the text. Earlier assistant calls and tool results in the history are
rendered in the same format, so they reach the chat template instead of being dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from producer_api.errors import ApiError
from schemas import ErrorCode

MAX_TOOLS = 128
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


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


class ParsedCall(BaseModel):
    name: str
    arguments: str


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[ParsedCall]]:
    """(content left, calls) from a generated text; calls that do not parse stay content."""
    if plan.mode == "forced":
        call = _parse_call(text, plan)
        return (None, [call]) if call is not None else (text, [])
    calls: list[ParsedCall] = []
    for match in _TOOL_CALL.finditer(text):
        call = _parse_call(match.group(1), plan)
        if call is not None:
            calls.append(call)
    if not calls:
        return text, []
    content = _TOOL_CALL.sub("", text).strip()
    return content or None, calls


def _parse_call(text: str, plan: ToolPlan) -> ParsedCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if value["name"] not in {t.function.name for t in plan.tools}:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ParsedCall(name=value["name"], arguments=json.dumps(arguments))


def tool_calls_body(calls: list[ParsedCall], call_id_prefix: str) -> list[dict[str, Any]]:
    return [
        {
            "id": f"{call_id_prefix}-{index}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for index, call in enumerate(calls)
    ]
