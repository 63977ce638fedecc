"""Tool calls: the functions a chat offers the model (OpenAI's `tools`), rendered by the checkpoint's chat
template, and the calls the model writes, parsed from its text.

One format is known, Hermes's, which Qwen2.5, Qwen3, SmolLM3 and the Hermes models' templates use: the
template lists the tools' JSON schemas and the model answers with one or more
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks. A template that does not take tools, or
takes them in a format not known here, is refused (ToolsError) rather than guessed at. A call can also be
required (`tool_call_grammar`): the reply is then constrained to one call of the offered functions, its
arguments valid against the function's parameter schema.
"""
from __future__ import annotations

import json
import re

from edge.constrained import Grammar
from edge.core.arguments import shown
from edge.core.errors import InvalidArgumentError

HERMES = "hermes"
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # as OpenAI allows


class ToolsError(InvalidArgumentError):
    """Tools that cannot be offered: malformed, or a chat template that does not take them."""


def check_tools(tools) -> list[dict]:
    """OpenAI's tools: a non-empty list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}} with distinct names; ToolsError names the first thing wrong."""
    if not isinstance(tools, list) or not tools:
        raise ToolsError(f"tools must be a non-empty list of {{\"type\": \"function\", \"function\": {{...}}}}, "
                         f"got {shown(tools)}")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ToolsError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             f"\"parameters\": {{...}}}}}}, got {shown(tool)}")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ToolsError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {shown(name)}")
        if name in names:
            raise ToolsError(f"tools[{i}].function.name {name!r} is offered twice")
        names.add(name)
        if not isinstance(function.get("description", ""), str):
            raise ToolsError(f"tools[{i}].function.description must be text, got {shown(function['description'])}")
        if not isinstance(function.get("parameters", {}), dict):
            raise ToolsError(f"tools[{i}].function.parameters must be a JSON schema object, got "
                             f"{shown(function['parameters'])}")
    return tools


def tool_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template uses, or None when it takes no tools or uses one not known here."""
    if chat_template and "tools" in chat_template and "<tool_call>" in chat_template:
        return HERMES
    return None


def require_tool_format(model) -> str:
    template = model.tokenizer.chat_template if model.tokenizer is not None else None
    found = tool_format(template)
    if found is None:
        said = "has no chat template" if not template else (
            "has a chat template that takes no tools" if "tools" not in template else
            "has a chat template whose tool-call format is not one zllm-edge knows")
        raise ToolsError(f"{model.path} {said}; tool calls need a template in Hermes's format (<tool_call> JSON, as "
                         "Qwen2.5, Qwen3 and SmolLM3 use); leave tools out")
    return found


def tool_call_grammar(tools: list[dict], name: str | None = None) -> Grammar:
    """The reply as one call of the offered functions (of `name` alone, if given), its arguments valid against
    the function's parameter schema."""
    functions = [tool["function"] for tool in check_tools(tools)]
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ToolsError(f"tool_choice names the function {name!r}, which tools does not offer")
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]},
                             "arguments": f.get("parameters") or {"type": "object"}}} for f in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return Grammar.lark('start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(schema) + "\n")


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(the text outside the calls, or None if nothing is left; the calls as {"name", "arguments"} with the
    arguments a dict). A block that is not a JSON object with a string name and object arguments stays in
    the text: it is not a call."""
    calls, kept, end = [], [], 0
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        arguments = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            continue
        calls.append({"name": call["name"], "arguments": arguments})
        kept.append(text[end:match.start()])
        end = match.end()
    kept.append(text[end:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls
