#!/usr/bin/env python3
# tests/chat/make_tool_cases.py: renders every shared chat template with Jinja2 itself (set
# up as make_jinja_snippets.py sets it up, the way Hugging Face's apply_chat_template does) on
# two conversations with tools -- a first turn offering a tool, and a whole round trip: the
# assistant's call, the tool's answer, the assistant's reply and a new question -- and writes
# tool_cases.json, the reference tool_template_test.cpp compares kiln's rendering against.
# An assistant turn that only calls a tool has content "" (as kiln and llama.cpp send it).
# A call's arguments go to the template as a JSON string, or as an object where the template
# prints them only that way (llama.cpp's capability probe, done here with Jinja2). Re-run:
#   python3 tests/chat/make_tool_cases.py ../shared/testdata/templates \
#     > tests/chat/tool_cases.json
import json
import os
import sys

import jinja2

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "template"))
from make_jinja_snippets import env  # noqa: E402

TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Get the current weather in a city",
                       "parameters": {"type": "object",
                                      "properties": {"city": {"type": "string", "description": "City name"},
                                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                      "required": ["city"]}}}]
ARGS = '{"city": "Paris", "unit": "celsius"}'


def conversation(object_args):
    args = json.loads(ARGS) if object_args else ARGS
    return [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": "call12345", "type": "function",
                             "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "content": '{"temperature": 21, "condition": "sunny"}',
             "tool_call_id": "call12345", "name": "get_weather"},
            {"role": "assistant", "content": "It is 21 °C and sunny in Paris."},
            {"role": "user", "content": "And in Tokyo?"}]


def render(tmpl, ctx):
    try:
        return {"output": tmpl.render(**ctx)}
    except jinja2.exceptions.TemplateError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    except Exception as e:  # a Python error inside the template (None + str, ...)
        return {"error": f"{type(e).__name__}: {e}"}


def wants_object_arguments(tmpl):
    def renders_key(as_object):
        args = {"argument_needle": "print('Hello, World!')"}
        msgs = [{"role": "user", "content": "Hey"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"id": "call_1___", "type": "function",
                                 "function": {"name": "ipython",
                                              "arguments": args if as_object else json.dumps(args)}}]}]
        out = render(tmpl, {"messages": msgs, "add_generation_prompt": False, "bos_token": "", "eos_token": ""})
        text = out.get("output", "")
        return any(n in text for n in ('"argument_needle":', "'argument_needle':",
                                       "<parameter=argument_needle>", "<arg_key>argument_needle</arg_key>"))
    return not renders_key(False) and renders_key(True)


def main():
    folder = sys.argv[1]
    e = env()
    out = {"generator": "tests/chat/make_tool_cases.py, Jinja2 " + jinja2.__version__,
           "bos_token": "<BOS>", "eos_token": "<EOS>", "tools": TOOLS, "templates": []}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".jinja"):
            continue
        tmpl = e.from_string(open(os.path.join(folder, name), encoding="utf-8").read())
        obj = wants_object_arguments(tmpl)
        entry = {"template": name, "object_arguments": obj, "cases": []}
        base = {"bos_token": "<BOS>", "eos_token": "<EOS>", "tools": TOOLS, "add_generation_prompt": True}
        msgs = conversation(obj)
        for case, messages in (("first-turn", msgs[:2]), ("round-trip", msgs)):
            c = {"name": case, "messages": messages}
            c.update(render(tmpl, dict(base, messages=messages)))
            entry["cases"].append(c)
        out["templates"].append(entry)
    json.dump(out, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
