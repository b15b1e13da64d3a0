"""A tokenizer folder's chat template, rendered exactly as transformers' apply_chat_template.

Where the template comes from (transformers' order): the folder's `chat_template.jinja` (what
recent transformers versions save), else tokenizer_config.json's "chat_template": a string, or
a list of {"name", "template"} from which "default" is taken.

How it is rendered (transformers.utils.chat_template_utils, 5.x): jinja2's
ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and the loopcontrols extension;
`tojson` without HTML escaping (json.dumps, ensure_ascii=False); the globals `raise_exception`
and `strftime_now` (the local date, so a template that prints today's date, as Llama 3.2's
does, renders differently on another day); a `{% generation %}` block that renders its body.
The variables are `messages`, `tools=None`, `documents=None`, `add_generation_prompt` and the
folder's named special tokens as strings (`bos_token`, `eos_token`, ...). The text is then
tokenized WITHOUT adding special tokens: the template writes bos itself where it wants one.
"""

from datetime import datetime
import functools
import json

from grpo_jax.run import paths

TEMPLATE_FILE = "chat_template.jinja"


def read(folder: str, tokenizer_config: dict) -> str | None:
  """The folder's chat template source, or None; `tokenizer_config`: its tokenizer_config.json."""
  jinja = paths.path(folder) / TEMPLATE_FILE
  if paths.exists(jinja):
    return paths.read_text(jinja)
  template = tokenizer_config.get("chat_template")
  if isinstance(template, list):  # named templates; apply_chat_template uses "default"
    template = {t["name"]: t["template"] for t in template}.get("default")
  return template or None


def special_tokens(config: dict, special_tokens_map: dict) -> dict[str, str]:
  """The named special tokens a template sees: every `*_token` key with a token value.

  `config` is tokenizer_config.json, `special_tokens_map` special_tokens_map.json (it fills
  tokens the config leaves out). Null tokens are left out, as transformers leaves them out of
  `special_tokens_map`; a tokenizer class's built-in defaults (a folder without any config)
  are not known here.
  """
  out = {}
  for source in (special_tokens_map, config):
    for key, value in source.items():
      if isinstance(value, dict):
        value = value.get("content")
      if key.endswith("_token") and isinstance(value, str):
        out[key] = value
  return out


def render(
    template: str,
    messages: list[dict],
    tokens: dict[str, str],
    *,
    add_generation_prompt: bool = True
) -> str:
  """The text transformers' apply_chat_template(messages, tokenize=False, ...) gives."""
  return _compile(template).render(
      messages=messages,
      tools=None,
      documents=None,
      add_generation_prompt=add_generation_prompt,
      **tokens
  )


@functools.lru_cache(maxsize=8)
def _compile(template: str):
  import jinja2
  import jinja2.ext
  from jinja2 import sandbox

  class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): the body as is."""

    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )

  env = sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  return env.from_string(template)
