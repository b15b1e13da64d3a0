"""The tool library (grpo_jax/rollout/tools/): schemas == transformers' get_json_schema, the
hermes format == Qwen3's chat template byte for byte, the loader's one-line errors, the runner
under hostile tools (hangs, raises, huge arguments, parallel calls, stateful instances), the
calculator's refusals and the python tool in the sandbox (escape attempts contained)."""

import json
import os
import threading
import time
from typing import Literal, Optional

import pytest

from grpo_jax.data import chat_template
from grpo_jax.rollout import tools
from grpo_jax.rollout.tools import builtin
from grpo_jax.rollout.tools import formats

HERMES, PLAIN = formats.get("hermes"), formats.get("plain")


# ============================================================================== schemas


def add(x: float, y: float = 1.0) -> float:
  """Adds two numbers.

  Args:
    x: The first number.
    y: The second number,
      which may span lines.

  Returns:
    The sum.
  """
  return x + y


def search(query: str, limit: Optional[int] = None, tags: list[int] | None = None) -> list[str]:
  """Searches the index.

  Args:
    query: What to look for.
    limit: At most this many results.
    tags: Only rows with these tag ids.
  """
  return []


def pick(mode: Literal["fast", "slow"], weights: dict[str, float], pair: tuple[int, str]):
  """Picks a mode.

  Args:
    mode: How to run.
    weights: A weight per name.
    pair: An id and its label.
  """


def drink(beverage: str, size: int | str = 1):
  """Drinks something.

  Args:
    beverage: The beverage to drink (choices: ["tea", "coffee"])
    size: Cups or a named size.
  """


@pytest.mark.parametrize("fn", [add, search, pick, drink, builtin.calculator])
def test_schema_equals_transformers(fn):
  from transformers.utils import get_json_schema

  assert tools.make_tool(fn).schema == get_json_schema(fn)


def test_python_schema_hides_the_runner_timeout():
  (schema,) = tools.load_tools("", "python").schemas()
  assert list(schema["function"]["parameters"]["properties"]) == ["code"]
  assert schema["function"]["parameters"]["required"] == ["code"]


class Counter:
  """A counter per row."""

  def __init__(self):
    self.created, self.released, self.values = [], [], {}

  def create(self):
    instance_id = f"c{len(self.created)}"
    self.created.append(instance_id)
    self.values[instance_id] = 0
    return instance_id

  def call(self, instance_id: str, step: int = 1) -> str:
    """Adds step to the row's counter and returns it.

    Args:
      step: How much to add.
    """
    time.sleep(0.01)  # calls of one instance overlapping would lose an update
    value = self.values[instance_id] + step
    self.values[instance_id] = value
    return str(value)

  def release(self, instance_id):
    self.released.append(instance_id)


class Lookup:
  name = "lookup"
  schema = {
      "name": "ignored",
      "description": "Looks a key up.",
      "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
  }

  def create(self):
    return 0

  def call(self, instance_id, **arguments):
    return arguments["key"].upper()

  def release(self, instance_id):
    pass


class Weather:
  name = "weather"
  description = "The weather in a city."
  parameters = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

  def create(self):
    return None

  def call(self, instance_id, city):
    return "sunny"

  def release(self, instance_id):
    pass


def test_class_tool_schemas():
  counter = tools.make_tool(Counter).schema["function"]
  assert counter["name"] == "Counter"
  assert counter["description"] == "Adds step to the row's counter and returns it."
  assert counter["parameters"] == {
      "type": "object",
      "properties": {"step": {"type": "integer", "description": "How much to add."}},
  }
  lookup = tools.make_tool(Lookup).schema
  assert lookup == {"type": "function", "function": {**Lookup.schema, "name": "lookup"}}
  weather = tools.make_tool(Weather).schema["function"]
  assert weather == {
      "name": "weather",
      "description": Weather.description,
      "parameters": Weather.parameters,
  }


# ================================================================================ loader

TOOL_FILE = '''
import time

class Thing:
  pass

def good(n: int) -> int:
  """Doubles n.

  Args:
    n: A number.
  """
  return 2 * n

def undocumented(n: int):
  return n

def nodesc(n: int):
  """Echo."""

def unhinted(n):
  """Echo.

  Args:
    n: A number.
  """

def custom(t: Thing):
  """Takes a thing.

  Args:
    t: The thing.
  """

class Half:
  """Half a tool."""
  def create(self):
    return 1
  def call(self, instance_id, x: int):
    """Calls.

    Args:
      x: A number.
    """

def calculator(expression: str) -> str:
  """A calculator that always says 42.

  Args:
    expression: Ignored.
  """
  return "42"
'''


@pytest.fixture
def tool_file(tmp_path):
  path = tmp_path / "my_tools.py"
  path.write_text(TOOL_FILE)
  return str(path)


def test_load_tools(tool_file):
  assert tools.load_tools(tool_file, "") is None
  assert tools.load_tools("", " ") is None
  toolset = tools.load_tools(tool_file, "good, python,calculator")
  assert toolset.names == ("good", "python", "calculator")
  assert toolset.get("calculator").fn(expression="1+1") == "42"  # the file's wins
  assert tools.load_tools("", "calculator").get("calculator").fn(expression="1+1") == "2"


@pytest.mark.parametrize(
    "name, says",
    [
        (
            "missing",
            "defines no tool 'missing' (it defines Half, Thing, calculator, custom, good, nodesc",
        ),
        ("undocumented", "tool 'undocumented' has no docstring"),
        ("unhinted", "parameter 'n' has no type hint"),
        ("nodesc", "the docstring does not describe parameter 'n'"),
        ("custom", "parameter 't' has type Thing, which a JSON schema cannot express"),
        ("Half", "tool 'Half' is a class without release"),
    ],
)
def test_loader_errors_name_file_and_tool(tool_file, name, says):
  with pytest.raises(tools.ToolConfigError) as e:
    tools.load_tools(tool_file, f"good,{name}")
  msg = str(e.value)
  assert "\n" not in msg and tool_file in msg and name in msg and "fix:" in msg
  assert says in msg


def test_loader_errors_of_the_file(tmp_path):
  def error(file, names="t"):
    with pytest.raises(tools.ToolConfigError) as e:
      tools.load_tools(file, names)
    assert "\n" not in str(e.value) and "fix:" in str(e.value)
    return str(e.value)

  assert "does not exist" in error(str(tmp_path / "nope.py"))
  bad = tmp_path / "bad.py"
  bad.write_text("import os\n\nx = {}\ny = x['key']\n")
  assert f"{bad}:4: importing it failed: KeyError: 'key'" in error(str(bad))
  bad.write_text("def f(:\n  pass\n")
  assert f"{bad}:1: importing it failed: SyntaxError" in error(str(bad))
  msg = error("", "mytool")
  assert "'mytool' is not a built-in tool (calculator, python)" in msg
  assert "rollout.tools.file" in msg


# ============================================================================== formats


def _qwen3_template() -> str:
  """Qwen3's published chat template (shipped with maxtext), else the copy the chat-template
  tests keep (the same text)."""
  import importlib.util

  spec = importlib.util.find_spec("maxtext")
  for root in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(root, "assets", "tokenizers", "qwen3-tokenizer", "tokenizer_config.json")
    if os.path.exists(path):
      with open(path) as f:
        return json.load(f)["chat_template"]
  from tests.data.test_chat_templates import QWEN3_TEMPLATE

  return QWEN3_TEMPLATE


def _render(messages, schemas, add_generation_prompt=True) -> str:
  # chat_template.render passes tools=None; the same compiled environment with tools= given.
  return chat_template._compile(_qwen3_template()).render(
      messages=messages,
      tools=schemas,
      documents=None,
      add_generation_prompt=add_generation_prompt,
      eos_token="<|im_end|>",
      pad_token="<|endoftext|>",
  )


SCHEMAS = [tools.make_tool(f).schema for f in (add, builtin.calculator)]


@pytest.mark.parametrize("system_prompt", ["", "You are terse."])
def test_system_block_is_qwen3_template_text(system_prompt):
  messages = [{"role": "user", "content": "What is 2+3?"}]
  if system_prompt:
    messages.insert(0, {"role": "system", "content": system_prompt})
  rendered = _render(messages, SCHEMAS)
  block = HERMES.system_block(SCHEMAS, system_prompt)
  want = f"<|im_start|>system\n{block}<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
  assert rendered == want + "<|im_start|>assistant\n"
  assert '{"type": "function", "function": {"name": "add", ' in block  # tojson: one per line
  assert "\n".join(json.dumps(s) for s in SCHEMAS) in block


def test_transformers_renders_the_same():
  from transformers.utils.chat_template_utils import render_jinja_template

  messages = [{"role": "user", "content": "Hi"}]
  (theirs,), _ = render_jinja_template(
      [messages], tools=SCHEMAS, chat_template=_qwen3_template(), add_generation_prompt=True
  )
  assert theirs == _render(messages, SCHEMAS)


@pytest.mark.parametrize("n_calls", [1, 2])
def test_call_and_response_text_is_qwen3_template_text(n_calls):
  """What the model writes in a tool-calling turn and what the engine appends after it are,
  together, exactly the template's rendering of that conversation plus the next turn's start."""
  calls = [("calculator", {"expression": "123*45"}), ("add", {"x": 1.5, "y": -2})][:n_calls]
  results = ["5535", "-0.5"][:n_calls]
  user = {"role": "user", "content": "Compute."}
  assistant = {
      "role": "assistant",
      "content": "Let me compute.",
      "tool_calls": [
          {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
      ],
  }
  tool_msgs = [{"role": "tool", "content": r} for r in results]
  prompt = _render([user], SCHEMAS)
  rendered = _render([user, assistant, *tool_msgs], SCHEMAS)
  turn = "Let me compute.\n" + "\n".join(HERMES.call_text(n, a) for n, a in calls)
  assert rendered == prompt + turn + HERMES.turn_end + HERMES.response_text(results)
  parsed = HERMES.parse_calls(turn)
  assert [(c.name, c.arguments, c.error) for c in parsed] == [(n, a, None) for n, a in calls]


def test_parse_calls_errors():
  turn = (
      'Sure.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+"}\n</tool_call>\n'
      "<tool_call>\n[1, 2]\n</tool_call>"
      '<tool_call>{"arguments": {}}</tool_call>'
      '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
      '<tool_call>{"name": "f", "arguments": 3}</tool_call>'
      '<tool_call>{"name": "f"}</tool_call>'
      '</tool_call><tool_call>\n{"name": "python", "arguments": {"code": "print('
  )
  got = HERMES.parse_calls(turn)
  assert [c.name for c in got] == ["calculator", None, None, "f", "f", "f", "python"]
  assert "not valid JSON" in got[0].error and got[0].arguments is None
  assert "not a JSON object" in got[1].error
  assert '"name"' in got[2].error
  assert got[3].arguments == {"a": 1} and got[3].error is None
  assert '"arguments" is not an object' in got[4].error
  assert got[5].arguments == {} and got[5].error is None
  assert got[6].error == "no closing </tool_call>" and got[6].raw.startswith('\n{"name"')
  assert HERMES.parse_calls("no calls here </tool_call>") == []


def test_plain_format():
  call = PLAIN.call_text("calculator", {"expression": "123*45"})
  assert (
      call == '<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>'
  )
  assert call.endswith(PLAIN.turn_end)
  (parsed,) = PLAIN.parse_calls("12 times 45 is " + call)
  assert (parsed.name, parsed.arguments) == ("calculator", {"expression": "123*45"})
  assert PLAIN.response_text(["5535"]) == "<tool_response>5535</tool_response>"
  assert PLAIN.system_block(SCHEMAS) == ""
  assert PLAIN.schema_text(SCHEMAS).splitlines() == [json.dumps(s) for s in SCHEMAS]


# ============================================================================ calculator


@pytest.mark.parametrize(
    "expression, value",
    [
        ("123*45", "5535"),
        ("-(2 + 3) ** 2", "-25"),
        ("7 // 2 + 7 % 2 + 7 / 2", "7.5"),
        ("2**-1", "0.5"),
    ],
)
def test_calculator(expression, value):
  assert builtin.calculator(expression) == value


@pytest.mark.parametrize(
    "expression, says",
    [
        ("__import__('os')", "a function call is not allowed"),
        ("x + 1", "the name 'x' is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("'a' * 3", "only numbers"),
        ("9**9**9", "more than 4000 bits"),
        ("(10**1000) * (10**1000)", "more than 4000 bits"),
        ("10.0 ** 400", "too large"),
        ("1 / 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an arithmetic expression"),
    ],
)
def test_calculator_refuses(expression, says):
  start = time.monotonic()
  with pytest.raises(ValueError, match=says):
    builtin.calculator(expression)
  assert time.monotonic() - start < 0.5


# ================================================================================ runner


def hang(seconds: float) -> str:
  """Sleeps.

  Args:
    seconds: How long.
  """
  time.sleep(seconds)
  return "woke"


def boom(message: str) -> str:
  """Raises.

  Args:
    message: The error's text.
  """
  raise ValueError(message)


def _call(name, **arguments):
  return formats.ParsedCall(name, arguments, None, json.dumps(arguments))


_MEETING = threading.Barrier(2)


def meet() -> str:
  """Waits until a second call arrives (both in the pool at once), then answers."""
  _MEETING.wait(timeout=5.0)
  return "met"


def _runner(*fns, **kw):
  toolset = tools.ToolSet([tools.make_tool(f) for f in fns])
  return tools.ToolRunner(toolset, **kw)


def test_runner_results_and_stats():
  with _runner(builtin.calculator, boom, timeout_sec=5.0, max_response_chars=70) as runner:
    calls = HERMES.parse_calls(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "9**9**9"}}</tool_call>'
        '<tool_call>{"name": "boom", "arguments": {"message": "broken"}}</tool_call>'
        '<tool_call>{"name": "boom", "arguments": {"message": "' + "x" * 100 + '"}}</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'
    )
    handle = runner.submit(7, calls)
    (results,) = runner.wait([handle])
    assert runner.poll() == []  # waited handles are not polled again
  assert [r.status for r in results] == [
      "ok",
      "error",
      "error",
      "error",
      "unknown_tool",
      "malformed",
      "error",
  ]
  assert results[0].text == "5535"
  assert results[1].text == "Error: ValueError: the result would have more than 4000 bits"
  assert results[2].text == "Error: ValueError: broken"
  assert results[3].text == "Error: ValueError: " + "x" * 51 + "\n[truncated: 49 more characters]"
  assert results[4].text == "Error: unknown tool 'nope'; the tools are: calculator, boom"
  assert results[5].text.startswith("Error: malformed tool call: not valid JSON")
  assert "unexpected keyword argument 'exp" in results[6].text
  assert not any("Traceback" in r.text for r in results)
  stats = runner.stats()
  assert stats["tool_call/calls"] == 7 and stats["tool_call/errors"] == 6
  assert stats["tool_call/calculator/calls"] == 4 and stats["tool_call/calculator/errors"] == 3
  assert stats["tool_call/boom/errors"] == 2 and stats["tool_call/unknown_tool"] == 1
  assert stats["tool_call/malformed"] == 1 and stats["tool_call/timeouts"] == 0
  runner.reset_stats()
  assert runner.stats()["tool_call/calls"] == 0


def test_runner_times_out_a_hung_tool_and_keeps_working():
  with _runner(hang, meet, timeout_sec=1.0, max_workers=2) as runner:
    start = time.monotonic()
    stuck = runner.submit(0, [_call("hang", seconds=1000)])
    (results,) = runner.wait([stuck])
    assert 0.9 < time.monotonic() - start < 10.0  # (a loaded machine: a generous bound)
    assert results[0].status == "timeout"
    assert results[0].text == "Error: the tool 'hang' did not answer within 1 s"
    # Both workers still serve (the stuck one was replaced): two calls that only return once
    # both run at the same time (a barrier of 2) both answer.
    _MEETING.reset()
    handles = [runner.submit(i, [_call("meet")]) for i in (1, 2)]
    assert [r[0].text for r in runner.wait(handles)] == ["met", "met"]
    stats = runner.stats()
    assert stats["tool_call/hang/timeouts"] == 1 and stats["tool_call/abandoned_threads"] == 1


def test_runner_refuses_huge_arguments():
  with _runner(builtin.calculator) as runner:
    (call,) = HERMES.parse_calls(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "'
        + "1+" * (5 << 20)
        + '1"}}</tool_call>'
    )
    handle = runner.submit(0, [call])
    assert handle.ready()  # refused at submit, nothing ran
    (result,) = handle.results
  assert result.status == "too_large" and "at most 1048576" in result.text


def test_runner_runs_calls_in_parallel():
  with _runner(hang, max_workers=8, timeout_sec=5.0) as runner:
    start = time.monotonic()
    handles = [runner.submit(i, [_call("hang", seconds=0.5)]) for i in range(6)]
    handles.append(runner.submit(6, [_call("hang", seconds=0.5)] * 2))  # one row, two calls
    done = []
    while len(done) < 7:
      done += runner.poll()
      time.sleep(0.01)
    assert time.monotonic() - start < 2.0
  assert sorted(h.row_id for h in done) == list(range(7))
  assert all(r.text == "woke" for h in done for r in h.results)


def test_runner_stateful_tool_instances():
  with _runner(Counter, builtin.calculator) as runner:
    counter = runner.toolset.get("Counter").obj
    runner.start(0)
    a = runner.submit(0, [_call("Counter", step=2), _call("Counter", step=3)])
    b = runner.submit(1, [_call("calculator", expression="1+1")])
    ra, rb = runner.wait([a, b])
    assert [r.text for r in ra] == ["2", "5"]  # in call order, one instance
    assert counter.created == ["c0"]  # row 1 made no instance
    (rc,) = runner.wait([runner.submit(0, [_call("Counter")])])
    assert rc[0].text == "6" and counter.created == ["c0"]
    (rd,) = runner.wait([runner.submit(2, [_call("Counter", step=10)])])
    assert rd[0].text == "10" and counter.created == ["c0", "c1"]
    with pytest.raises(ValueError, match="finish"):
      runner.start(0)
    runner.wait([runner.finish(0), runner.finish(1), runner.finish(2)])
    assert sorted(counter.released) == ["c0", "c1"]


def test_runner_never_raises_from_a_tool_thread():
  """A tool that kills its own thread's exception machinery (SystemExit) is still an answer."""

  def leave(code: int) -> str:
    """Exits.

    Args:
      code: The code.
    """
    raise SystemExit(code)

  with _runner(leave, builtin.calculator, timeout_sec=1.0, max_workers=1) as runner:
    (results,) = runner.wait([runner.submit(0, [_call("leave", code=3)])])
    assert results[0].status == "error" and "SystemExit" in results[0].text
    (results,) = runner.wait([runner.submit(0, [_call("calculator", expression="2*3")])])
    assert results[0].text == "6"


# ====================================================================== python (sandbox)


def _python(code, timeout_sec=5.0):
  with tools.ToolRunner(tools.load_tools("", "python"), timeout_sec=timeout_sec) as runner:
    (results,) = runner.wait([runner.submit(0, [_call("python", code=code)])])
  return results[0]


def test_python_tool_output():
  r = _python("import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)\n{}['k']")
  assert r.status == "ok"
  assert r.text.startswith('42\nwarn\nTraceback (most recent call last):\n  File "<code>", line 4')
  assert r.text.endswith("KeyError: 'k'\n")
  assert "_source" not in r.text  # the wrapper's own frame is left out
  assert _python("x = 1").text == "(no output)"
  big = _python("print('a' * 100000)").text
  assert big.endswith("[truncated: 95905 more bytes]\n") and len(big) < 4200


@pytest.mark.parametrize(
    "code, says",
    [
        ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)", "PermissionError"),
        ("open('/tmp/grpo_escape_probe', 'w').write('x')", "PermissionError"),
        ("import os\nos.fork()", "PermissionError"),
        ("open('/proc/1/environ').read()", "PermissionError"),
    ],
)
def test_python_tool_contains_escapes(code, says):
  r = _python(code)
  assert r.status == "ok" and says in r.text  # the program's own failure, told to the model
  assert not os.path.exists("/tmp/grpo_escape_probe")


def test_python_tool_hides_the_environment(monkeypatch):
  monkeypatch.setenv("GRPO_TEST_SECRET", "hunter2")
  r = _python("import os\nprint(dict(os.environ))")
  assert "hunter2" not in r.text and "GRPO_TEST_SECRET" not in r.text and "HOME" in r.text


def test_python_tool_times_out():
  start = time.monotonic()
  r = _python("import time\nprint('started', flush=True)\ntime.sleep(100)", timeout_sec=2.0)
  assert time.monotonic() - start < 3.0
  assert r.status == "timeout" and "ran longer than 1.6 s" in r.text and "started" in r.text
