#!/usr/bin/env python3
"""Renders chat templates the way transformers' apply_chat_template(tokenize=False) does, for the
C++ tests to compare zerotrain's built-in formats with (tests/test_chat_templates.cpp).

    render_chat_templates.py JOB.json OUT.json

JOB.json: {"template": PATH, "bos_token": STR|null, "eos_token": STR|null,
           "cases": [{"messages": [...], "add_generation_prompt": BOOL,
                      "tools": [...]|null, "kwargs": {...}}, ...]}
OUT.json: [{"text": STR} | {"error": STR, "raised": BOOL}, ...], one entry per case.

Messages are passed as given (OpenAI-style objects: tool_calls, tool_call_id, reasoning_content
...); "tools" (JSON-schema function definitions) is passed as `tools` (None when absent, as
transformers passes it), "kwargs" as further template variables (enable_thinking, ...).
"raised": the template called raise_exception; otherwise jinja2 (or Python under it) failed
with the error's type and message in "error".

transformers (chat_template_utils) compiles templates in an ImmutableSandboxedEnvironment with
trim_blocks and lstrip_blocks, the loopcontrols extension, its own tojson filter (json.dumps,
no HTML escaping) and the globals raise_exception and strftime_now; special tokens that are
None are not passed (Qwen's bos_token is undefined inside its template).
"""
import json
import sys
from datetime import datetime

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(Exception):
    pass


def raise_exception(message):
    raise TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def main():
    job = json.load(open(sys.argv[1], encoding="utf-8"))
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    with open(job["template"], encoding="utf-8", newline="") as f:
        template = env.from_string(f.read())
    tokens = {k: job[k] for k in ("bos_token", "eos_token") if job.get(k) is not None}
    out = []
    for case in job["cases"]:
        try:
            out.append({"text": template.render(messages=case["messages"], tools=case.get("tools"), documents=None,
                                                add_generation_prompt=case.get("add_generation_prompt", False),
                                                **tokens, **case.get("kwargs", {}))})
        except TemplateError as e:
            out.append({"error": str(e), "raised": True})
        except Exception as e:  # what jinja2 itself refuses: an undefined used, a wrong type
            out.append({"error": f"{type(e).__name__}: {e}", "raised": False})
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
