"""Tool calls (edge/tools.py): tools offered through a chat template in Hermes's format, calls parsed from the
reply into OpenAI's tool_calls, a required call constrained to the offered functions; and through the server.
SmolLM2, its own template (which takes no tools) and a copy of it given a Hermes-style template."""
from __future__ import annotations

import json
import shutil

import pytest
from test_serve import ServerProcess, _model_name

import edge
from edge.tools import ToolsError, check_tools, parse_tool_calls, tool_call_grammar, tool_format
from quant.checkpoint import sealed

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 24},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}}, "required": ["zone"],
    "additionalProperties": False}}}

# Qwen2.5's template, as its tokenizer_config.json has it, reduced to what these tests render
HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}"
    "{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' }}{{- message.content }}"
    "{{- '\\n</tool_response><|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_calls_are_parsed_from_the_reply_and_what_is_not_a_call_stays_text():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    assert parse_tool_calls(text) == ("Let me look.", [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                                       {"name": "get_time", "arguments": {"zone": "CET"}}])
    assert parse_tool_calls("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>") == \
        (None, [{"name": "f", "arguments": {}}])
    for not_a_call in ("no call at all", "<tool_call>{not json}</tool_call>", "<tool_call>[1, 2]</tool_call>",
                       '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
                       '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
                       '<tool_call>{"name": "f", "arguments": {}}'):  # never closed
        assert parse_tool_calls(not_a_call) == (not_a_call, [])


@pytest.mark.parametrize("tools, message", [
    ([], "tools must be a non-empty list"),
    ({"type": "function"}, "tools must be a non-empty list"),
    ([{"type": "retrieval"}], "tools[0] must be {\"type\": \"function\""),
    ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name must be 1-64 letters"),
    ([WEATHER, WEATHER], "tools[1].function.name 'get_weather' is offered twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}],
     "tools[0].function.parameters must be a JSON schema object"),
])
def test_malformed_tools_are_refused(tools, message):
    with pytest.raises(ToolsError, match=None) as raised:
        check_tools(tools)
    assert str(raised.value).startswith(message)


def test_the_format_is_told_by_the_template():
    assert tool_format(HERMES_TEMPLATE) == "hermes"
    assert tool_format("{{ messages }}") is None
    assert tool_format("{% if tools %}{{ tools | tojson }}{% endif %}[TOOL_CALLS]") is None  # another format


@pytest.fixture(scope="module")
def hermes_checkpoint(smollm2_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hermes") / "smollm2-hermes"
    shutil.copytree(smollm2_checkpoint, folder)
    manifest = json.loads((folder / "zllm.json").read_text())
    manifest["tokenizer"]["chat_template"] = HERMES_TEMPLATE
    (folder / "zllm.json").write_text(json.dumps(sealed(manifest)))
    return folder


def test_a_required_call_is_one_call_of_an_offered_function_with_valid_arguments(hermes_checkpoint):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with edge.load(str(hermes_checkpoint), device="cpu", threads=1) as model:
        offered = model.chat(messages, tools=[WEATHER, TIME], max_new_tokens=1)
        plain = model.chat(messages, max_new_tokens=1)
        "".join(offered), "".join(plain)
        assert len(offered.result.prompt_tokens) > len(plain.result.prompt_tokens) + 50  # the tools were rendered
        reply = "".join(model.chat(messages, tools=[WEATHER, TIME], max_new_tokens=80,
                                   grammar=tool_call_grammar([WEATHER, TIME], "get_weather")))
    content, calls = parse_tool_calls(reply)
    assert content is None and [call["name"] for call in calls] == ["get_weather"], reply
    jsonschema.validate(calls[0]["arguments"], WEATHER["function"]["parameters"])


def test_a_template_without_tools_refuses_them(smollm2_checkpoint):
    with edge.load(str(smollm2_checkpoint)) as model:
        with pytest.raises(ToolsError, match="has a chat template that takes no tools; tool calls need a template "
                                             "in Hermes's format"):
            model.chat([{"role": "user", "content": "Hi"}], tools=[WEATHER])
    with pytest.raises(ToolsError, match="tool_choice names the function 'nope', which tools does not offer"):
        tool_call_grammar([WEATHER], "nope")


@pytest.fixture(scope="module")
def hermes_server(hermes_checkpoint):
    process = ServerProcess(hermes_checkpoint)
    yield process
    process.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_answers_a_required_call_as_tool_calls(hermes_server, stream):
    client = hermes_server.client()
    kwargs = dict(model=_model_name(hermes_server), max_tokens=80, temperature=0, tools=[WEATHER, TIME],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [call for d in deltas for call in (d.tool_calls or [])]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        arguments, name = calls[0].function.arguments, calls[0].function.name
        assert calls[0].index == 0 and calls[0].id.startswith("call_")
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        finish, calls = choice.finish_reason, choice.message.tool_calls
        arguments, name = calls[0].function.arguments, calls[0].function.name
        assert choice.message.content is None and calls[0].type == "function"
    assert (finish, len(calls), name) == ("tool_calls", 1, "get_weather")
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])

    # the conversation goes on with the call's result
    messages = kwargs["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21, "unit": "celsius"})}]
    reply = client.chat.completions.create(**{**kwargs, "messages": messages, "tool_choice": "auto",
                                              "max_tokens": 8})
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [WEATHER]}, "tools", "has a chat template that takes no tools"),
    ({"tools": []}, "tools", "tools must be a non-empty list"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "tool_choice names the function 'nope', which tools does not offer"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", 'tool_choice must be "none", "auto"'),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice asks for a tool call, and the request offers no tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "a required tool call and response_format cannot both shape the reply"),
    ({"functions": [WEATHER["function"]]}, "functions", "functions and function_call are OpenAI's older form"),
])
def test_tools_the_server_cannot_offer_are_a_400(plain_server, body, param, message):
    response = httpx.post(f"{plain_server.url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **body})
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (400, param), error
    assert message in error["message"]


def test_tools_on_a_completion_are_a_400(plain_server):
    response = httpx.post(f"{plain_server.url}/v1/completions", timeout=60,
                          json={"prompt": "Hi", "max_tokens": 2, "tools": [WEATHER]})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == ("tools are offered through a chat template: use "
                                                   "/v1/chat/completions")


@pytest.fixture(scope="module")
def plain_server(smollm2_checkpoint):
    """SmolLM2 with its own template, which takes no tools."""
    process = ServerProcess(smollm2_checkpoint)
    yield process
    process.stop()
