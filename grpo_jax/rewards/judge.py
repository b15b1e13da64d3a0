"""A learned-judge reward: a frozen Hugging Face model scores each completion in [0, 1].

    judge = build_judge(config, mesh)                  # None when reward.judge.path is ""
    scores_n = judge(prompts, completions)             # np.float32 [n], this process's rows
    total_n += config.reward.judge.weight * scores_n   # logged as reward/judge

The judge reads `template.format(prompt=..., completion=...)`, tokenized with the judge's own
tokenizer, left-padded to `max_length`, and scores it in one of two modes:

  classifier  a sequence-classification head (transformers' Qwen3ForSequenceClassification /
              LlamaForSequenceClassification layout: `score.weight` [num_labels, D], no bias) on
              the final hidden state of the last real token. One label: sigmoid(logit); more:
              softmax(logits)[label_index].
  yes_prob    the next-token probability of `yes_token` after the text (a causal LM), either
              p(yes) / (p(yes) + p(no)) (normalize="yes_no") or p(yes) over the whole
              vocabulary (normalize="vocab").

The decoder is the native Transformer (loaded like any HF checkpoint, sharded over the same
mesh as the policy) run by one jitted function of fixed shape [batch_size, max_length], so it
compiles once. Multi-host: every process passes its own rows (the same count on every process);
chunks of batch_size // process_count rows per process become global arrays (`to_global`), and
each process reads back its own scores (`local_rows`), one transfer for all chunks.

The filled text is tokenized whole (as transformers' tokenizer reads it). A text longer than
max_length keeps the template's own text and loses prompt tokens from the left (the prompt's
end stays next to the completion); only when no prompt is left is the completion cut, keeping
its beginning. The cut text is tokenized whole again, so only the cut itself is new.
"""

import functools
import math
import string

from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from grpo_jax.parallel import multihost
from grpo_jax.run import paths
from grpo_jax.parallel import sharding
from grpo_jax.models.decoder import hf
from grpo_jax.models import safetensors_io
from grpo_jax.models.decoder.config import DTYPES
from grpo_jax.models.decoder.config import ModelConfig
from grpo_jax.models.decoder.transformer import Transformer

MODES = ("classifier", "yes_prob")
NORMALIZE = ("yes_no", "vocab")
FIELDS = ("prompt", "completion")
METRIC = "reward/judge"  # the per-function metric name, beside reward/<function>

DEFAULT_TEMPLATE = (
    "Task:\n{prompt}\n\nResponse:\n{completion}\n\n"
    "Is the response a correct and helpful answer to the task? Answer yes or no.\nAnswer:"
)


def default_config() -> ml_collections.ConfigDict:
  """config.reward.judge (configs/common.py)."""
  c = ml_collections.ConfigDict()
  # Hugging Face checkpoint folder of the judge (config.json + *.safetensors, local or gs://):
  # a *ForSequenceClassification model (mode=classifier) or a *ForCausalLM (mode=yes_prob),
  # Qwen3 or Llama 3. "" = no judge.
  c.path = ""
  # classifier: the score head (`score.weight`) on the last token; yes_prob: the probability
  # of yes_token as the next token after the filled template.
  c.mode = "yes_prob"
  # The judge's weight in the total reward (like reward.weights for the named functions).
  c.weight = 0.5
  # The judge's input, a Python format string with {completion} (once) and optionally
  # {prompt} (at most once); literal braces as {{ }}. Include whatever the judge was trained
  # on: a BOS token for Llama judges ("<|begin_of_text|>..."), a chat template's markup
  # ("<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n") for instruct judges.
  c.template = DEFAULT_TEMPLATE
  # yes_prob: the token strings whose next-token probabilities are compared; each must be
  # exactly one token of the judge's tokenizer (mind the leading space: " yes" vs "Yes").
  c.yes_token = " yes"
  c.no_token = " no"
  # yes_prob: "yes_no" = p(yes) / (p(yes) + p(no)); "vocab" = p(yes) over the whole vocabulary.
  c.normalize = "yes_no"
  # classifier with num_labels > 1: the label whose softmax probability is the score (a
  # [bad, good] head: 1). Ignored for a single-logit head (sigmoid).
  c.label_index = 1
  # Texts per jitted judge call, over all hosts (a multiple of mesh data * fsdp and of the
  # process count); a batch of rows is scored in ceil(rows / batch_size) calls.
  c.batch_size = 32
  # Judge input tokens per text (the compiled width); longer texts lose prompt tokens first.
  c.max_length = 2048
  # The judge's tokenizer folder; "" = the checkpoint folder itself.
  c.tokenizer_path = ""
  # Compute and parameter dtype of the frozen judge (the heads run in float32).
  c.dtype = "bfloat16"
  return c


# --------------------------------------------------------------------------------- template


def parse_template(template: str) -> list[tuple[str, str]]:
  """[(kind, text)]: kind "text" (literal, braces unescaped), "prompt" or "completion".
  Raises ValueError naming what is wrong."""
  pieces = []
  for literal, field, spec, conversion in string.Formatter().parse(template):
    if literal:
      pieces.append(("text", literal))
    if field is None:
      continue
    if field not in FIELDS:
      raise ValueError(f"has the field {{{field}}}; only {{prompt}} and {{completion}} exist")
    if spec or conversion:
      raise ValueError(
          f"formats {{{field}}} with !{conversion or ''}:{spec or ''}; the "
          "fields take no conversion or format spec"
      )
    pieces.append((field, ""))
  kinds = [k for k, _ in pieces]
  if kinds.count("completion") != 1:
    raise ValueError(
        f"has {kinds.count('completion')} {{completion}} fields; it needs exactly " "one"
    )
  if kinds.count("prompt") > 1:
    raise ValueError(f"has {kinds.count('prompt')} {{prompt}} fields; at most one")
  return pieces


# ------------------------------------------------------------------------------- validation


def validate(
    config, *, data_parallel: int | None = None, num_processes: int | None = None
) -> list[str]:
  """One `reward.judge.<field>=value: why. Fix: ...` line per bad value of config.reward.judge
  (empty when it is good or off). Reads config.json, the safetensors headers and the tokenizer
  when the paths exist (cheap); `data_parallel` (mesh data * fsdp) checks batch_size."""
  j = config.reward.judge
  out = []

  def fail(field, why, fix):
    out.append(f"reward.judge.{field}={j[field]!r}: {why}. Fix: {fix}.")

  if not j.path:
    return out
  if j.mode not in MODES:
    fail("mode", "unknown judge mode", f"use one of {', '.join(MODES)}")
  if j.normalize not in NORMALIZE:
    fail("normalize", "unknown normalization", f"use one of {', '.join(NORMALIZE)}")
  if j.dtype not in DTYPES:
    fail("dtype", "unknown dtype", f"use one of {', '.join(DTYPES)}")
  if not isinstance(j.weight, (int, float)) or not math.isfinite(j.weight):
    fail("weight", "must be a finite number", "e.g. 0.5")
  if not isinstance(j.label_index, int) or j.label_index < 0:
    fail("label_index", "must be an integer >= 0", "the index of the 'good' label, e.g. 1")
  if not isinstance(j.batch_size, int) or j.batch_size < 1:
    fail("batch_size", "must be >= 1", "e.g. 32")
  else:
    for n, what in ((data_parallel, "mesh data * fsdp"), (num_processes, "JAX processes")):
      if n and j.batch_size % n:
        fail(
            "batch_size",
            f"does not split over the {n} {what}",
            f"use a multiple of {n}, e.g. {n * -(-j.batch_size // n)}",
        )
  if not isinstance(j.max_length, int) or j.max_length < 2:
    fail("max_length", "must be >= 2", "e.g. 2048 (template + prompt + completion tokens)")
  pieces = None
  try:
    pieces = parse_template(j.template)
  except ValueError as e:
    fail(
        "template",
        str(e),
        "write e.g. 'Question: {prompt} Answer: {completion} Correct?' "
        "(literal braces as {{ }})",
    )
  missing = False
  for field in ("path", "tokenizer_path"):
    problem = paths.check_scheme(j[field]) if j[field] else None
    if not problem and j[field] and not paths.isdir(j[field]):
      problem = (
          "is not a folder",
          "give the judge's Hugging Face checkpoint folder"
          if field == "path"
          else 'give a tokenizer folder, or "" for the checkpoint\'s',
      )
    if problem:
      fail(field, *problem)
      missing = True
  if missing:  # the checks below read those folders
    return out
  vocab_size = _check_checkpoint(j, fail)
  _check_tokenizer(j, fail, pieces, vocab_size)
  return out


def _check_checkpoint(j, fail) -> int | None:
  """The checkpoint's config.json and head tensors; -> its vocab_size (None when unreadable)."""
  try:
    hf_cfg = hf.read_hf_config(j.path)
    cfg = ModelConfig.from_hf_config(hf_cfg)
    names = hf._Checkpoint(j.path).files
  except (OSError, ValueError, KeyError) as e:
    fail(
        "path",
        f"is not a loadable checkpoint ({e})",
        "give a Qwen3 / Llama Hugging Face " "checkpoint folder (config.json + *.safetensors)",
    )
    return None
  if j.mode == "classifier":
    if "score.weight" not in names:
      fail(
          "path",
          "has no score.weight (no sequence-classification head)",
          "give a *ForSequenceClassification checkpoint, or use mode=yes_prob for a causal LM",
      )
    else:
      num_labels = _tensor_shape(names, "score.weight")[0]
      if num_labels > 1 and isinstance(j.label_index, int) and j.label_index >= num_labels:
        fail(
            "label_index",
            f"is out of range for the head's {num_labels} labels",
            f"use 0..{num_labels - 1}",
        )
  elif j.mode == "yes_prob" and not cfg.tie_embeddings and "lm_head.weight" not in names:
    fail(
        "path",
        "has no lm_head.weight (not a causal LM)",
        "give a *ForCausalLM checkpoint, or use mode=classifier for a classification head",
    )
  return cfg.vocab_size


def _check_tokenizer(j, fail, pieces, vocab_size):
  try:
    tok = _tokenizer(j.tokenizer_path or j.path)
  except (OSError, ValueError) as e:
    fail(
        "tokenizer_path",
        f"has no usable tokenizer ({e})",
        "point at a folder with " "tokenizer.json, or vocab.json + merges.txt",
    )
    return
  if vocab_size is not None and tok.vocab_size > vocab_size:
    fail(
        "tokenizer_path",
        f"gives token ids up to {tok.vocab_size - 1} but the judge's "
        f"vocab_size is {vocab_size}",
        "use the tokenizer the judge was trained with",
    )
  if j.mode == "yes_prob":
    ids = {}
    for field in ("yes_token", "no_token"):
      got = tok.encode(j[field]) if isinstance(j[field], str) else []
      if len(got) != 1:
        fail(
            field,
            f"is {len(got)} tokens {got} in the judge's tokenizer, not one",
            "use a string that is a single token (try with or without a leading space)",
        )
      else:
        ids[field] = got[0]
    if len(ids) == 2 and ids["yes_token"] == ids["no_token"] and j.normalize == "yes_no":
      fail("no_token", "is the same token as yes_token", "use the 'no' answer's token")
  if pieces is not None and isinstance(j.max_length, int):
    fixed = len(tok.encode("".join(t for k, t in pieces if k == "text")))
    if fixed + 1 > j.max_length:
      fail(
          "max_length",
          f"leaves no room: the template's own text is {fixed} tokens",
          f"raise it above {fixed} plus the prompt and completion tokens",
      )


def _tensor_shape(files: dict, name: str) -> tuple:
  return tuple(safetensors_io.SafetensorsFile(files[name]).header[name]["shape"])


# ---------------------------------------------------------------------------------- loading


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str):
  """The judge's tokenizer, read once for validation and the build."""
  from grpo_jax.data import build_tokenizer

  return build_tokenizer("hf", path)


def _load_decoder(path: str, dtype, mesh, *, lm_head: bool) -> Transformer:
  """`hf.load_hf`; a checkpoint without an LM head (a *ForSequenceClassification folder with
  untied embeddings) loads as tied when none is needed (its unembedding is never used)."""
  untied_without_head = not hf.read_hf_config(path).get("tie_word_embeddings") and (
      "lm_head.weight" not in hf._Checkpoint(path).files
  )
  if lm_head or not untied_without_head:
    return hf.load_hf(path, dtype, mesh=mesh)
  return hf.load_hf(path, dtype, mesh=mesh, tie_embeddings=True)


def build_judge(config, mesh) -> "Judge | None":
  """The judge of config.reward.judge on `mesh`, or None when reward.judge.path is ""."""
  j = config.reward.judge
  if not j.path:
    return None
  for field, names in (("mode", MODES), ("normalize", NORMALIZE)):
    if j[field] not in names:
      raise ValueError(
          f"reward.judge.{field}={j[field]!r}: unknown. Fix: use one of " f"{', '.join(names)}."
      )
  pieces = parse_template(j.template)
  dp, procs = sharding.data_parallel_size(mesh), jax.process_count()
  if j.batch_size % dp or j.batch_size % procs:
    raise ValueError(
        f"reward.judge.batch_size={j.batch_size}: does not split over mesh data * "
        f"fsdp = {dp} and {procs} processes. Fix: use a multiple of "
        f"{math.lcm(dp, procs)}."
    )
  tokenizer = _tokenizer(j.tokenizer_path or j.path)
  head = yes_id = no_id = None
  if j.mode == "classifier":
    ckpt = hf._Checkpoint(j.path)
    if "score.weight" not in ckpt.files:
      raise ValueError(
          f"reward.judge.path={j.path!r}: has no score.weight (no sequence-"
          "classification head). Fix: give a *ForSequenceClassification checkpoint, "
          "or use mode=yes_prob."
      )
    head = np.asarray(ckpt.get("score.weight"), np.float32)  # [L, D]
    if head.shape[0] > 1 and not 0 <= j.label_index < head.shape[0]:
      raise ValueError(
          f"reward.judge.label_index={j.label_index}: out of range for the head's "
          f"{head.shape[0]} labels. Fix: use 0..{head.shape[0] - 1}."
      )
    head = multihost.replicated(head, mesh)
  else:
    yes_id, no_id = (_single_token(tokenizer, j, f) for f in ("yes_token", "no_token"))
  model = _load_decoder(j.path, jnp.dtype(j.dtype), mesh, lm_head=j.mode == "yes_prob")
  return Judge(
      model,
      tokenizer,
      mesh,
      mode=j.mode,
      pieces=pieces,
      head_ld=head,
      yes_id=yes_id,
      no_id=no_id,
      normalize=j.normalize,
      label_index=j.label_index,
      batch_size=j.batch_size,
      max_length=j.max_length,
  )


def _single_token(tokenizer, j, field) -> int:
  ids = tokenizer.encode(j[field])
  if len(ids) != 1:
    raise ValueError(
        f"reward.judge.{field}={j[field]!r}: is {len(ids)} tokens {ids} in the "
        "judge's tokenizer, not one. Fix: use a single-token string."
    )
  return ids[0]


# ------------------------------------------------------------------------------------ judge


class Judge:
  """Scores (prompt, completion) pairs with a frozen model; see the module docstring."""

  def __init__(
      self,
      model: Transformer,
      tokenizer,
      mesh,
      *,
      mode,
      pieces,
      head_ld,
      yes_id,
      no_id,
      normalize,
      label_index,
      batch_size,
      max_length,
  ):
    self.tokenizer, self.mesh, self.pieces = tokenizer, mesh, pieces
    self.max_length = max_length
    self.rows_per_call = batch_size // jax.process_count()  # this process's rows per call
    fixed = len(self._encode("", ""))
    if fixed + 1 > max_length:
      raise ValueError(
          f"reward.judge.max_length={max_length}: the template's own text is "
          f"{fixed} tokens. Fix: raise max_length well above {fixed}."
      )
    graphdef, self._state = nnx.split(model)
    self._head = head_ld

    def scores(state, head_ld, ids_bt, mask_bt):
      judge = nnx.merge(graphdef, state)
      h_bd = judge.hidden(ids_bt, mask_bt)[:, -1]  # left-padded: the last slot is the last token
      if mode == "classifier":
        logits_bl = jnp.einsum(
            "bd,ld->bl", h_bd.astype(jnp.float32), head_ld, preferred_element_type=jnp.float32
        )
        if logits_bl.shape[-1] == 1:
          return jax.nn.sigmoid(logits_bl[:, 0])
        return jax.nn.softmax(logits_bl, axis=-1)[:, label_index]
      logits_bv = judge.logits_from_hidden(h_bd[:, None])[:, 0]
      if normalize == "yes_no":
        return jax.nn.sigmoid(logits_bv[:, yes_id] - logits_bv[:, no_id])
      return jnp.exp(logits_bv[:, yes_id] - jax.nn.logsumexp(logits_bv, axis=-1))

    self._scores = jax.jit(scores, out_shardings=sharding.batch_sharding(mesh, 1))

  def encode(self, prompt: str, completion: str) -> list[int]:
    """The judge's input ids for one pair, at most max_length (see the module docstring)."""
    ids = self._encode(prompt, completion)
    if len(ids) <= self.max_length:
      return ids
    # Keep the prompt's last k tokens (as text) and tokenize the whole text again, so only the
    # cut differs from how the judge's tokenizer reads the text; k shrinks until it fits.
    prompt_ids = self.tokenizer.encode(prompt)
    k = len(prompt_ids) - (len(ids) - self.max_length)
    while k > 0 and len(ids) > self.max_length:
      ids = self._encode(self.tokenizer.decode(prompt_ids[-k:], skip_special=False), completion)
      k -= len(ids) - self.max_length
    if len(ids) <= self.max_length:
      return ids
    # No prompt left and still too long: keep the completion's first k tokens.
    completion_ids = self.tokenizer.encode(completion)
    ids = self._encode("", completion)
    k = len(completion_ids) - (len(ids) - self.max_length)
    while k > 0 and len(ids) > self.max_length:
      ids = self._encode("", self.tokenizer.decode(completion_ids[:k], skip_special=False))
      k -= len(ids) - self.max_length
    return ids if len(ids) <= self.max_length else self._encode("", "")[-self.max_length :]

  def _encode(self, prompt: str, completion: str) -> list[int]:
    fill = {"prompt": prompt, "completion": completion}
    return self.tokenizer.encode("".join(fill.get(k, t) for k, t in self.pieces))

  def _padded(self, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """[rows_per_call, max_length] ids and mask, left-padded; filler rows are one pad token."""
    ids = np.full((self.rows_per_call, self.max_length), self.tokenizer.pad_id, np.int32)
    mask = np.zeros_like(ids)
    mask[:, -1] = 1
    for r, row in enumerate(rows):
      ids[r, self.max_length - len(row) :] = row
      mask[r, self.max_length - len(row) :] = 1
    return ids, mask

  def __call__(self, prompts: list[str], completions: list[str]) -> np.ndarray:
    """np.float32 [n] scores in [0, 1] for this process's n rows (every process calls this
    with the same n: the judge runs on the global batch)."""
    if len(prompts) != len(completions):
      raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    rows = [self.encode(p, c) for p, c in zip(prompts, completions)]
    step = self.rows_per_call
    outs = []
    with jax.set_mesh(self.mesh):
      for start in range(0, len(rows), step):
        ids, mask = self._padded(rows[start : start + step])
        outs.append(
            self._scores(
                self._state,
                self._head,
                multihost.to_global(ids, self.mesh),
                multihost.to_global(mask, self.mesh),
            )
        )
    if not outs:
      return np.zeros((0,), np.float32)
    scores = np.concatenate(multihost.local_rows(outs))[: len(rows)]
    return scores.astype(np.float32)

  def close(self):
    """Drops the judge's device arrays (the loop's teardown)."""
    self._state = self._head = self._scores = None
