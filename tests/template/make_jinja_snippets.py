#!/usr/bin/env python3
# tests/template/make_jinja_snippets.py: renders small templates with Jinja2 itself (set up
# as Hugging Face's apply_chat_template does) and writes jinja_snippets.json, the reference
# the interpreter's unit tests compare against. Re-run after editing SNIPPETS:
#   python3 tests/template/make_jinja_snippets.py > tests/template/jinja_snippets.json
import json
import sys
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

NOW = "2026-11-29T12:00:00"


class Generation(Extension):  # HF's AssistantTracker without the mask bookkeeping
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_gen"), [], [], body).set_lineno(lineno)

    def _gen(self, caller):
        return caller()


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def strftime_now(fmt):
    return datetime.fromisoformat(NOW).strftime(fmt)


def env():
    e = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    e.filters["tojson"] = tojson
    e.globals["raise_exception"] = raise_exception
    e.globals["strftime_now"] = strftime_now
    return e


MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <there> & 'you'"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Zürich — 東京 🙂"}]
CTX = {"messages": MSGS, "bos_token": "<s>", "eos_token": "</s>", "n": 7, "f": 2.5, "s": "  Hello World  ",
       "xs": [3, 1, 2], "words": ["b", "A", "c", "a"], "d": {"b": 1, "a": [1, 2.0, None, True], "c": {"x": "y"}},
       "tools": [{"type": "function", "function": {"name": "get", "parameters": {"city": "str"}}},
                 {"type": "code", "function": {"name": "run"}}],
       "empty": [], "none": None, "flag": True}

SNIPPETS = [
    # output and literals
    "{{ 1 }} {{ 1.0 }} {{ 1e-05 }} {{ 1.5e20 }} {{ 0.1 + 0.2 }} {{ 10 / 4 }} {{ 10 // 4 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 2 ** 10 }}",
    "{{ true }} {{ false }} {{ none }} {{ True }} {{ None }}",
    "{{ [1, 'a', none, true, 2.5] }} {{ {'k': 'v', 'n': [1]} }} {{ ('a',) }} {{ (1, 2) }}",
    "{{ \"it's\" }} {{ ['it\\'s', \"q\\\"\"] }} {{ 'a\\nb\\tc' }} {{ ['a\\nb'] }} {{ '\\u00e9\\x41' }}",
    "{{ 'a' 'b' }}{{ 'x' ~ 1 ~ none ~ true }}",
    "{{ 'ab' * 3 }}{{ 3 * '-' }}{{ [1] * 2 }}{{ [1] + [2] }}",
    "{{ 7 * 1.0 }} {{ 1 + true }} {{ 3 / 1 }} {{ 100000000000000000.0 }} {{ 1e16 }} {{ 123456789.125 }} {{ -0.0 }}",
    # whitespace control
    "a\n  {% if true %}\n  b\n  {% endif %}\nc",
    "a  {%- if true -%}  b  {%- endif -%}  c",
    "x {{- ' y ' -}} z",
    "{# comment #}\n  {#- c2 -#}  text\n{% raw %}{{ not parsed }}{% endraw %}",
    "line\n    {%+ if true %}kept{% endif %}\n{% if true +%}\nnext{% endif %}",
    "{% for x in xs %}\n  {{ x }}\n{% endfor %}\n",
    "  {% set a = 1 %}{{ a }}\n  {{ a }}",
    # conditionals
    "{% if n > 5 %}big{% elif n > 2 %}mid{% else %}small{% endif %}",
    "{{ 'y' if flag else 'n' }}{{ 'y' if not flag }}|{{ 1 if none is none else 2 }}",
    "{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'a' in 'cat' }} {{ 'z' not in ['a'] }} {{ 'k' in {'k': 1} }}",
    "{{ none or 'x' }} {{ 0 and 1 }} {{ [] or [1] }} {{ not '' }}",
    # loops
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }}:{{ m.role }}{{ ',' if not loop.last }}{% endfor %}",
    "{% for x in xs %}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.cycle('a','b') }} {% endfor %}",
    "{% for x in xs %}[{{ loop.previtem }}|{{ loop.nextitem }}]{% endfor %}",
    "{% for x in xs if x > 1 %}{{ x }}{{ loop.length }}{% else %}none{% endfor %}{% for x in empty %}{{ x }}{% else %}E{% endfor %}",
    "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}",
    "{% for x in xs %}{% if x == 1 %}{% continue %}{% endif %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}",
    "{% for c in 'héllo' %}{{ c }}.{% endfor %}{% for x in undefined_thing %}never{% endfor %}",
    "{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %}",
    "{% for item in [{'c': [{'c': []}]}, {'c': []}] recursive %}<{{ loop.depth }}{{ loop(item.c) }}>{% endfor %}",
    "{% set x = 1 %}{% for i in xs %}{% set x = i %}{% endfor %}{{ x }}",
    # set, namespace, with
    "{% set ns = namespace(c=0, seen=[]) %}{% for x in xs %}{% set ns.c = ns.c + x %}{% endfor %}{{ ns.c }}",
    "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = (1, 2) %}{{ t[0] }}",
    "{% set block %}\n  inner {{ n }}\n{% endset %}[{{ block }}]{% set up | upper %}abc{% endset %}{{ up }}",
    "{% with a = 5, b = 6 %}{{ a * b }}{% endwith %}{{ a is defined }}",
    "{% set ns = namespace(d={'a': 1}) %}{{ ns.d.a }}{{ ns }}",
    # macros
    "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Bob') }} {{ greet('Al', punct='?') }} {{ greet(name='X') }}",
    "{% macro m(a) %}{{ a }}|{{ varargs }}|{{ kwargs }}{% endmacro %}{{ m(1, 2, 3, k=4) }}{{ m() }}",
    "{% macro wrap() %}<{{ caller() }}>{% endmacro %}{% call wrap() %}body {{ n }}{% endcall %}",
    "{% macro row(x) %}[{{ caller(x * 2) }}]{% endmacro %}{% call(v) row(3) %}v={{ v }}{% endcall %}",
    "{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(4) }}",
    # filters
    "{{ s | trim }}|{{ s | upper }}|{{ s | lower }}|{{ 'hello wORLD' | title }}|{{ 'hello World' | capitalize }}",
    "{{ xs | length }} {{ 'héllo' | length }} {{ d | count }} {{ xs | first }} {{ xs | last }} {{ xs | sum }} {{ xs | min }} {{ xs | max }}",
    "{{ words | sort }} {{ words | sort(case_sensitive=true) }} {{ xs | sort(reverse=true) }} {{ words | unique | list }}",
    "{{ d | dictsort }} {{ d | items | list }} {{ xs | reverse | list }} {{ 'abc' | reverse }} {{ xs | list }}",
    "{{ xs | join(', ') }} {{ words | join }} {{ messages | map(attribute='role') | join(' ') }}",
    "{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | list }}",
    "{{ messages | rejectattr('role', 'eq', 'user') | list | length }} {{ xs | select('odd') | list }} {{ xs | reject('even') | list }}",
    "{{ tools | selectattr('type', 'equalto', 'function') | map(attribute='function.name') | list }}",
    "{{ missing | default('dflt') }} {{ '' | default('e', true) }} {{ none | default('n') }} {{ missing | d }}",
    "{{ 'a-b-c' | replace('-', '+') }} {{ 'aaa' | replace('a', 'b', 2) }} {{ '3' | int + 1 }} {{ '2.5' | float }} {{ 'x' | int }} {{ '4.7' | int }}",
    "{{ -3 | abs }} {{ 2.567 | round(2) }} {{ 2.5 | round }} {{ 3.2 | round(method='ceil') }} {{ 7 | round }} {{ 42 | string }}",
    "{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'x\\ny' | indent(2, true) }}|{{ 'p\\n\\nq' | indent(blank=true) }}",
    "{{ '<b>x</b> &' | e }} {{ '<i>y</i>' | striptags }} {{ 'one two  three' | wordcount }} {{ 'ab' | center(6) }}|",
    "{{ 'the quick brown fox jumps' | truncate(12) }}|{{ 'the quick brown fox jumps' | truncate(12, true) }}",
    "{{ xs | batch(2) | list }} {{ [1, 2, 3] | batch(2, 0) | list }} {{ 'x%sy%d' | format('A', 5) }}",
    "{{ messages[1] | tojson }}",
    "{{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ d | tojson(sort_keys=true) }}|{{ d | tojson(separators=(',', ':')) }}",
    "{{ 'Zürich 🙂 \"q\" \\\\ \\n\\t' | tojson }} {{ 'Zürich 🙂' | tojson(ensure_ascii=true) }} {{ 1.0 | tojson }} {{ none | tojson }} {{ [] | tojson(indent=2) }}",
    "{{ tools | tojson(indent=4) }}",
    "{{ xs | map('string') | join('-') }} {{ ['a', 'b'] | map('upper') | list }}",
    "{{ d.c | items | list }} {{ {} | items | list }}",
    "{% filter upper %}shout {{ n }}{% endfilter %}",
    # tests
    "{{ n is defined }} {{ nope is undefined }} {{ none is none }} {{ s is string }} {{ n is number }} {{ f is float }} {{ n is integer }} {{ flag is boolean }}",
    "{{ d is mapping }} {{ xs is iterable }} {{ xs is sequence }} {{ s is iterable }} {{ n is iterable }} {{ d is sequence }}",
    "{{ 4 is even }} {{ 3 is odd }} {{ 9 is divisibleby 3 }} {{ 9 is divisibleby(4) }} {{ 'A' is upper }} {{ 'a' is lower }}",
    "{{ 1 is eq 1 }} {{ 2 is gt 1 }} {{ 'a' is in 'abc' }} {{ none is sameas none }} {{ flag is true }} {{ flag is false }} {{ n is not none }}",
    "{% macro greet() %}{% endmacro %}{{ greet is callable }} {{ range is callable }} {{ n is callable }} {{ 'ab' is sameas 'ab' }}",
    # string methods
    "{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ 'xxhixx'.strip('x') }}|{{ '--a--'.lstrip('-') }}|{{ '\\n\\nq\\n'.strip() }}",
    "{{ 'a,b,,c'.split(',') }} {{ '  a  b '.split() }} {{ 'a b c'.split(' ', 1) }} {{ 'a.b.c'.rsplit('.', 1) }} {{ 'l1\\nl2\\r\\nl3'.splitlines() }}",
    "{{ 'hello'.startswith('he') }} {{ 'hello'.endswith(('x', 'lo')) }} {{ 'hello'.replace('l', 'L') }} {{ 'hello'.find('l') }} {{ 'héllo'.find('l') }} {{ 'hello'.count('l') }}",
    "{{ 'Hello'.upper() }} {{ 'Hello'.lower() }} {{ 'hello world'.title() }} {{ 'hELLO'.capitalize() }} {{ '42'.isdigit() }} {{ 'ab'.isalpha() }} {{ ' '.isspace() }}",
    "{{ '{} and {}'.format('a', 'b') }} {{ '{0}{1}{0}'.format('x', 'y') }} {{ '{name}!'.format(name='N') }} {{ '{:>5}|{:<4}|{:^5}|{:.2f}|{:03d}'.format('r', 'l', 'c', 3.14159, 7) }}",
    "{{ '-'.join(['a', 'b']) }} {{ 'abc'[1] }} {{ 'abcdef'[1:4] }} {{ 'abcdef'[::-1] }} {{ 'abcdef'[-2:] }} {{ 'héllo'[1:3] }}",
    "{{ '%s=%d' % ('k', 3) }} {{ '%05.1f' % 3.14159 }} {{ '%(a)s' % {'a': 1} }} {{ 'x'.zfill(3) }} {{ 'ab'.center(6, '*') }}",
    "{{ 'a:b:c'.partition(':') }} {{ 'prefix-x'.removeprefix('prefix-') }} {{ 'ÄÖ straße'.upper() }} {{ 'ÀB'.lower() }}",
    # list and dict access
    "{{ xs[0] }} {{ xs[-1] }} {{ xs[1:] }} {{ xs[::2] }} {{ xs[:-1] }} {{ messages[0]['role'] }} {{ messages[0].content }} {{ d['a'][1] }}",
    "{{ d.get('a') }} {{ d.get('zz') }} {{ d.get('zz', 5) }} {{ d.keys() | list }} {{ d.values() | list | length }} {{ d.items() | list | first }}",
    "{{ xs.index(2) }} {{ xs.count(3) }} {{ d.c.x }} {{ d['c']['x'] }} {{ messages.0.role }}",
    "{{ range(3) | list }} {{ range(1, 10, 3) | list }} {{ dict(a=1, b=2) }} {{ namespace(x=1).x }}",
    "{{ strftime_now('%Y-%m-%d %H:%M') }} {{ strftime_now('%d %b %Y, %A') }}",
    "{% generation %}gen {{ n }}{% endgeneration %}",
    "{% set j = joiner(', ') %}{% for x in xs %}{{ j() }}{{ x }}{% endfor %}",
    # undefined behaviour
    "[{{ nope }}][{{ nope ~ 'x' }}][{{ nope | length }}][{{ nope is defined }}][{{ nope == nope }}][{{ d.nothing }}][{{ xs[10] }}]",
    "{% if nope %}yes{% else %}no{% endif %}{% if nope.attr is defined %}{% endif %}",
    "{{ messages[0].nothing is defined }} {{ (messages | first).role }}",
    # errors
    "{{ raise_exception('custom failure') }}",
    "{{ nope.attr }}",
    "{{ nope + 1 }}",
    "{{ d.nothing.deeper }}",
    "{{ 'a' + 1 }}",
    "{{ 1 + 'a' }}",
    "{{ 1 / 0 }}",
    "{{ xs.append(4) }}",
    "{{ d.update({'z': 1}) }}",
    "{{ none | length }}",
    "{% for x in none %}{% endfor %}",
    "{{ undefined_fn() }}",
    "{{ d | tojson }}{{ nope | tojson }}",
    "{% if %}{% endif %}",
    "{% for x in xs %}",
    "{{ 1 + }}",
    "{% unknowntag %}",
    "{{ xs | nosuchfilter }}",
    "{{ range(200000) | length }}",
]


def main():
    e = env()
    out = []
    for src in SNIPPETS:
        entry = {"template": src}
        try:
            entry["output"] = e.from_string(src).render(**CTX)
        except Exception as ex:  # noqa: BLE001 - the kind and message are the reference
            entry["error"] = f"{type(ex).__name__}: {ex}"
        out.append(entry)
    doc = {
        "provenance": f"generated by tests/template/make_jinja_snippets.py with Jinja2 {jinja2.__version__} "
                      "(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols, HF tojson)",
        "now": NOW,
        "context": CTX,
        "snippets": out,
    }
    json.dump(doc, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
