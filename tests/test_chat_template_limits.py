"""A chat template is a program from the model's files. One that loops without end, builds huge strings
or numbers, or formats with an enormous width ends in a TemplateLimitError within the limits of one
rendering (edge/tokenizer.py TEMPLATE_*), instead of holding the caller or filling memory."""
from __future__ import annotations

import pytest

from edge.tokenizer import TEMPLATE_CHARACTERS, TemplateLimitError, Tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]

HOSTILE = {
    "nested loops that print nothing": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "took more than"),
    "nested loops over a string": (
        "{% set s = 'ab' * 4000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", "took more than"),
    "a repeated string": ("{{ 'a' * 10000000000 }}", "would make a value of 10,000,000,000 characters"),
    "a power": ("{{ 7 ** 100000000 }}", "would make a number of about"),
    "a squaring loop": ("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
                        "{% endfor %}{{ ns.x }}", "would make a number of about"),
    "a doubling loop": ("{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = ns.x + ns.x %}"
                        "{% endfor %}{{ ns.x|length }}", "would make a value of"),
    "a printf width": ("{{ '%0999999999d' % 1 }}", "formats with a width or precision past"),
    "the format filter's width": ("{{ '%.999999999f'|format(1) }}", "formats with a width or precision past"),
    "str.format's width": ("{{ '{:>999999999}'.format(1) }}", "formats with a width or precision past"),
    "a filter's width": ("{{ 'a'|center(1000000000) }}", "asked for a size of 1,000,000,000"),
    "tojson's indent": ("{{ messages|tojson(indent=1000000000) }}", "asked for a size of 1,000,000,000"),
    "a flood of text": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
                        f"wrote more than {TEMPLATE_CHARACTERS:,} characters"),
}


class TemplateOnly(Tokenizer):
    """A tokenizer that has nothing but its chat template."""

    def __init__(self, template: str):
        self.chat_template, self.bos_token_id, self.eos_token_id = template, None, None


@pytest.mark.parametrize("template, complaint", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_template_past_the_limits_of_one_rendering_is_refused(template, complaint):
    with pytest.raises(TemplateLimitError) as raised:
        TemplateOnly(template).apply_chat_template(MESSAGES)
    assert str(raised.value).startswith(f"the checkpoint's chat template {complaint}")
    assert str(raised.value).endswith("generate with a plain prompt, or convert the model from a source with a "
                                      "working template")


def test_what_real_templates_do_stays_within_the_limits():
    """Loops over messages and tools, macros, namespaces, string building, tojson and small arithmetic."""
    template = ("{% set ns = namespace(n=0, text='') %}{% macro show(m) %}<{{ m.role }}>{{ m.content }}{% endmacro %}"
                "{% for m in messages * 50 %}{% set ns.n = ns.n + 1 %}{% set ns.text = ns.text ~ show(m) %}"
                "{% if loop.index % 2 == 0 %}{{ '%03d'|format(loop.index) }}{% endif %}{% endfor %}"
                "{{ ns.text }}{{ ns.n * 2 ** 10 }}{{ messages|tojson(indent=2) }}{{ '{:>4}'.format('x') }}")
    text = TemplateOnly(template).apply_chat_template(MESSAGES)
    assert text.count("<user>hi") == 50 and "51200" in text and text.endswith("   x")
