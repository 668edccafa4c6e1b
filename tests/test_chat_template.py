"""render_chat_template / apply_chat_template against transformers' own apply_chat_template.

The templates below are data: SmolLM2's comes from the shipped model; Qwen3's, Llama 3.1's
and Gemma 3's are the official ones from their Hugging Face repositories.
"""

from __future__ import annotations

import datetime

import pytest
import tokenizers
from tokenizers.models import WordLevel

from infer.chat import ChatTemplateError, apply_chat_template, content_format, render_chat_template

QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Gemma 3 (instruction-tuned): reads content-part lists and raises on non-alternating roles.
GEMMA3_IT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

SPECIALS = {
    "qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama31": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "gemma3": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city — “quoted” <b>HTML</b> & ünïcode",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello! What's 2+2?"}],
    "system+user": [
        {"role": "system", "content": "You are terse.  "},
        {"role": "user", "content": "  Name three colours. 日本語 👋🏽  "},
    ],
    "multi-turn": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the tensor cross the road?"},
        {"role": "user", "content": "Why?"},
    ],
    "text-parts": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " world"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]},
    ],
    "ends-with-assistant": [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "Hi!"},
    ],
}
# Conversations each template can render (SmolLM2's concatenates content as a string).
STRING_CONVS = ["user", "system+user", "multi-turn", "ends-with-assistant"]
ALTERNATING_CONVS = ["user", "system+user", "multi-turn", "text-parts", "ends-with-assistant"]


def hf_render(template, messages, add_generation_prompt, specials, **kwargs):
    """The reference: transformers' own apply_chat_template(tokenize=False).

    A tiny word-level backend stands in for the vocabulary (nothing is tokenized); the special
    tokens are set on the HF tokenizer, so they reach the template through special_tokens_map.
    """
    from transformers import PreTrainedTokenizerFast

    backend = tokenizers.Tokenizer(WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
    return hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                  add_generation_prompt=add_generation_prompt, **kwargs)


# ------------------------------------------------------------------ SmolLM2 (the shipped model)


@pytest.mark.parametrize("conv", STRING_CONVS)
@pytest.mark.parametrize("gen", [True, False])
def test_smollm2_template_matches_transformers(smollm2, conv, gen):
    tok = smollm2.tokenizer
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    messages = CONVERSATIONS[conv]
    specials = {k: v for k, v in tok.special_tokens.items() if v is not None}
    ours = apply_chat_template(tok, messages, add_generation_prompt=gen)
    assert ours == hf_render(tok.chat_template, messages, gen, specials)
    assert ours == render_chat_template(tok.chat_template, messages, add_generation_prompt=gen)
    assert ours.endswith("<|im_start|>assistant\n") is gen


def test_smollm2_prompt_layout(smollm2):
    out = apply_chat_template(smollm2.tokenizer, CONVERSATIONS["user"])
    assert out == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHello! What's 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


def joined(messages):
    """The reference for string templates (vLLM's rule): text parts joined with a newline, a
    missing content as ""."""
    out = []
    for m in messages:
        c = m.get("content")
        out.append({**m, "content": "" if c is None else c if isinstance(c, str)
                    else "\n".join(p["text"] for p in c)})
    return out


def test_content_format_detection(smollm2):
    """Templates that loop over a message's content get parts; the others a string (vLLM)."""
    assert content_format(smollm2.tokenizer.chat_template) == "string"
    assert content_format(QWEN3_TEMPLATE) == "string"  # content is string, else ''
    assert content_format(LLAMA31_TEMPLATE) == "string"
    assert content_format(GEMMA3_IT_TEMPLATE) == "openai"  # loop_messages = messages[1:] ... for item in content
    assert content_format("{% for m in messages %}{% for p in m['content'] | list %}{{ p.text }}"
                          "{% endfor %}{% endfor %}") == "openai"
    assert content_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "string"


def test_smollm2_text_parts_are_joined(smollm2):
    # SmolLM2's template does `'...' + message['content']`, which cannot add a list (transformers
    # raises TypeError): the parts are joined first, as vLLM does.
    template = smollm2.tokenizer.chat_template
    with pytest.raises(TypeError):
        hf_render(template, CONVERSATIONS["text-parts"], True, {})
    ours = render_chat_template(template, CONVERSATIONS["text-parts"])
    assert ours == hf_render(template, joined(CONVERSATIONS["text-parts"]), True, {})
    assert "<|im_start|>user\nHello\n world<|im_end|>" in ours


def test_smollm2_tool_call_history_renders(smollm2):
    """An assistant turn with ``content: null`` and ``tool_calls`` (what OpenAI clients send
    back) renders with an empty content instead of failing the template."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "21 C", "tool_call_id": "c1"},
                {"role": "user", "content": "Thanks"}]
    ours = apply_chat_template(smollm2.tokenizer, messages)
    specials = {k: v for k, v in smollm2.tokenizer.special_tokens.items() if v is not None}
    assert ours == hf_render(smollm2.tokenizer.chat_template, joined(messages), True, specials)
    assert "<|im_start|>assistant\n<|im_end|>" in ours


# ------------------------------------------------------------------ official templates


@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("family,template", [("qwen3", QWEN3_TEMPLATE), ("llama31", LLAMA31_TEMPLATE),
                                             ("gemma3", GEMMA3_IT_TEMPLATE)])
def test_official_templates_match_transformers(family, template, conv, gen):
    messages = CONVERSATIONS[conv]
    specials = SPECIALS[family]
    # text parts: as given to templates that read them, joined for string templates (vLLM)
    expected = hf_render(template, joined(messages) if content_format(template) == "string" else messages, gen,
                         specials)
    assert render_chat_template(template, messages, add_generation_prompt=gen, **specials) == expected


@pytest.mark.parametrize("kwargs", [{"enable_thinking": False}, {"enable_thinking": True}, {}])
def test_qwen3_enable_thinking(kwargs):
    messages = CONVERSATIONS["system+user"]
    ours = render_chat_template(QWEN3_TEMPLATE, messages, **kwargs)
    assert ours == hf_render(QWEN3_TEMPLATE, messages, True, SPECIALS["qwen3"], **kwargs)
    assert ours.endswith("<think>\n\n</think>\n\n") is (kwargs.get("enable_thinking") is False)


def test_qwen3_tools_reasoning_and_tool_messages():
    messages = [
        {"role": "system", "content": "Use tools when needed."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temp_c": 21, "sky": "clear"}'},
        {"role": "assistant", "content": "<think>\nIt is clear.\n</think>\n\nSunny, 21 °C."},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "Tomorrow: rain.", "reasoning": "From the forecast."},
    ]
    for gen in (True, False):
        expected = hf_render(QWEN3_TEMPLATE, messages, gen, SPECIALS["qwen3"], tools=[WEATHER_TOOL])
        ours = render_chat_template(QWEN3_TEMPLATE, messages, add_generation_prompt=gen, tools=[WEATHER_TOOL],
                                    **SPECIALS["qwen3"])
        assert ours == expected
    assert '"description": "Current weather in a city — “quoted” <b>HTML</b> & ünïcode"' in ours  # not escaped
    assert "<think>\nFrom the forecast.\n</think>" in ours  # "reasoning" aliased to reasoning_content


def test_llama31_tools_and_date():
    messages = [
        {"role": "system", "content": "You help with weather."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "21 C, clear"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    for kwargs in ({"tools": [WEATHER_TOOL]}, {"tools": [WEATHER_TOOL], "tools_in_user_message": False},
                   {"date_string": "01 Jan 2026", "builtin_tools": ["brave_search", "code_interpreter"]}):
        expected = hf_render(LLAMA31_TEMPLATE, messages, True, SPECIALS["llama31"], **kwargs)
        ours = render_chat_template(LLAMA31_TEMPLATE, messages, **SPECIALS["llama31"], **kwargs)
        assert ours == expected
        assert ours.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")


def test_llama31_raise_exception_becomes_chat_template_error():
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": {}}},
                                                     {"function": {"name": "b", "arguments": {}}}]}]
    with pytest.raises(ChatTemplateError, match="single tool-calls"):
        render_chat_template(LLAMA31_TEMPLATE, messages, bos_token="<|begin_of_text|>")


def test_gemma3_roles_must_alternate():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="alternate"):
        render_chat_template(GEMMA3_IT_TEMPLATE, messages)
    with pytest.raises(ValueError):  # ChatTemplateError is a ValueError: a server's 400
        render_chat_template(GEMMA3_IT_TEMPLATE, messages)


def test_gemma3_system_text_parts():
    # Gemma 3's template reads content-part lists itself (the system prompt's first part).
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": " Hello "}, {"type": "text", "text": "world"}]}]
    ours = render_chat_template(GEMMA3_IT_TEMPLATE, messages, **SPECIALS["gemma3"])
    assert ours == hf_render(GEMMA3_IT_TEMPLATE, messages, True, SPECIALS["gemma3"])
    assert ours == "<bos><start_of_turn>user\nBe brief.\n\nHelloworld<end_of_turn>\n<start_of_turn>model\n"


def test_tojson_and_strftime_now():
    template = ("{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':'), sort_keys=true) }}"
                "|{{ strftime_now('%Y') }}{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}"
                "{{ m.content }}{% endfor %}")
    x = {"b": "<é>", "a": [1, 2]}
    messages = [{"role": "user", "content": "skipped"}, {"role": "user", "content": "kept"}]
    ours = render_chat_template(template, messages, x=x)
    assert ours == hf_render(template, messages, True, {}, x=x)
    assert ours.startswith('{"b": "<é>", "a": [1, 2]}|')
    assert ours.endswith(f"|{datetime.datetime.now().year}kept")


def test_sandbox_blocks_unsafe_access():
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}",
                             [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        render_chat_template("{% set ns = namespace(_x=1) %}", [{"role": "user", "content": "x"}])


def test_invalid_template_syntax():
    with pytest.raises(ChatTemplateError, match="not valid Jinja2"):
        render_chat_template("{% for m in messages %}", [{"role": "user", "content": "x"}])


# ------------------------------------------------------------------ message validation


@pytest.mark.parametrize(
    "messages,match",
    [
        ([], "empty"),
        ("hello", "list"),
        (["hello"], "dict"),
        ([{"content": "no role"}], "role"),
        ([{"role": "robot", "content": "x"}], "role"),
        ([{"role": "user"}], "content"),
        ([{"role": "user", "content": None}], "content"),
        ([{"role": "user", "content": 42}], "string or a list"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], "image_url"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}], "only 'text'"),
        ([{"role": "user", "content": ["plain string part"]}], "dict"),
        ([{"role": "user", "content": [{"type": "text"}]}], "text"),
    ],
)
def test_bad_messages_raise_value_error(messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat_template(QWEN3_TEMPLATE, messages)


def test_no_chat_template_raises(gemma3):
    assert gemma3.tokenizer.chat_template is None  # gemma3-270m is a base model
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(gemma3.tokenizer, CONVERSATIONS["user"])
