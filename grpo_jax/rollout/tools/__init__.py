"""Tools for multi-turn rollouts: what a tool is (spec), the built-ins, loading a user's file,
the call / response text formats, and the runner the engine hands calls to (host side, no JAX).

    toolset = load_tools(config.rollout.tools.file, config.rollout.tools.names)  # or None
    fmt = formats.get("hermes")                          # or "plain"
    runner = ToolRunner(toolset, timeout_sec=10.0, max_workers=16, max_response_chars=16384)
    handle = runner.submit(row_id, fmt.parse_calls(turn_text))
    ... runner.poll() -> finished handles; fmt.response_text([r.text for r in handle.results])
"""

from grpo_jax.rollout.tools import formats
from grpo_jax.rollout.tools.builtin import calculator
from grpo_jax.rollout.tools.builtin import python
from grpo_jax.rollout.tools.formats import ParsedCall
from grpo_jax.rollout.tools.formats import ToolFormat
from grpo_jax.rollout.tools.loader import load_tools
from grpo_jax.rollout.tools.runner import STATUSES
from grpo_jax.rollout.tools.runner import ToolHandle
from grpo_jax.rollout.tools.runner import ToolResult
from grpo_jax.rollout.tools.runner import ToolRunner
from grpo_jax.rollout.tools.spec import Tool
from grpo_jax.rollout.tools.spec import ToolConfigError
from grpo_jax.rollout.tools.spec import ToolSet
from grpo_jax.rollout.tools.spec import make_tool
