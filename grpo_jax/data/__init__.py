"""Datasets and sources (`load_rows`), prompt templates, tokenizers, the synthetic arithmetic
task and the grain pipeline."""

from grpo_jax.data.arithmetic import arithmetic_rows
from grpo_jax.data.datasets import DataError
from grpo_jax.data.datasets import READERS
from grpo_jax.data.datasets import read_gsm8k
from grpo_jax.data.datasets import read_prompt_file
from grpo_jax.data.datasets import read_xsum
from grpo_jax.data.pipeline import PromptData
from grpo_jax.data.pipeline import eval_batches
from grpo_jax.data.pipeline import batches_per_epoch
from grpo_jax.data.pipeline import make_prompt_iterator
from grpo_jax.data.pipeline import sft_batch
from grpo_jax.data.sources import SOURCES
from grpo_jax.data.sources import load_rows
from grpo_jax.data.templates import render_prompt
from grpo_jax.data.templates import system_prompt
from grpo_jax.data.tokenizers import CharTokenizer
from grpo_jax.data.tokenizers import HFTokenizer
from grpo_jax.data.tokenizers import build_tokenizer
