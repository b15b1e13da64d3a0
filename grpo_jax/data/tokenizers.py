"""Tokenizers behind one small protocol: encode, decode, vocab_size, pad_id, eos_id, stop_ids,
and the chat template a folder ships (`chat_template`, `special_tokens`; data/chat_template.py).

- CharTokenizer: one id per character for the tiny CPU task, plus atomic special tokens
  (`<answer>` is ONE id), so a completion like `<answer>42</answer>` is 4 tokens.
- HFTokenizer: a Hugging Face byte-level BPE tokenizer (Qwen2/2.5/3, Llama 3) from a folder
  with tokenizer.json, or vocab.json + merges.txt (Qwen's published files), via the
  `tokenizers` package; no hub access.
"""

import json
from typing import Protocol, Sequence

from grpo_jax.run import paths
from grpo_jax.data import chat_template as chat_template_lib


class Tokenizer(Protocol):
  vocab_size: int
  pad_id: int
  eos_id: int
  stop_ids: tuple[int, ...]
  path: str  # the folder it was read from ("" when built in)
  chat_template: str | None  # jinja source, None when the tokenizer has none
  special_tokens: dict[str, str]  # bos_token, eos_token, ... as the template sees them

  def encode(self, text: str) -> list[int]:
    ...

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    ...


CHAR_SPECIALS = (
    "<pad>",
    "<eos>",
    "<reasoning>",
    "</reasoning>",
    "<answer>",
    "</answer>",
    "<think>",
    "</think>",
)
CHAR_ALPHABET = (
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" " \n+-*/=()[].,?!:;'\"%$#&<>_"
)

# The char tokenizer of the tool demo (configs/tiny_tools.py): tool-call markers atomic, and the
# braces of a call's JSON arguments. Its ids are its own (the markers shift the alphabet's).
CHAR_TOOL_SPECIALS = CHAR_SPECIALS + (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
CHAR_TOOL_ALPHABET = CHAR_ALPHABET + "{}"


class CharTokenizer:
  """Characters of a fixed alphabet plus atomic special tokens (ids 0.., `<pad>` = 0)."""

  def __init__(self, specials: Sequence[str] = CHAR_SPECIALS, alphabet: str = CHAR_ALPHABET):
    self.specials = tuple(specials)
    self.itos = list(self.specials) + list(dict.fromkeys(alphabet))
    self.stoi = {s: i for i, s in enumerate(self.itos)}
    self._by_length = sorted(self.specials, key=len, reverse=True)
    self.vocab_size = len(self.itos)
    self.pad_id = self.stoi["<pad>"]
    self.eos_id = self.stoi["<eos>"]
    self.stop_ids = (self.eos_id,)
    self.path = ""
    self.chat_template = None
    self.special_tokens = {"pad_token": "<pad>", "eos_token": "<eos>"}

  def encode(self, text: str) -> list[int]:
    ids, i = [], 0
    while i < len(text):
      for s in self._by_length:
        if text.startswith(s, i):
          ids.append(self.stoi[s])
          i += len(s)
          break
      else:
        ch = text[i]
        if ch not in self.stoi:
          raise ValueError(
              f"character {ch!r} at offset {i} of {text[:40]!r} is not in the "
              "char tokenizer's alphabet (grpo_jax.data.tokenizers.CHAR_ALPHABET)"
          )
        ids.append(self.stoi[ch])
        i += 1
    return ids

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    table = self._skip_table if skip_special else self.itos
    n = self.vocab_size
    return "".join([table[i] if 0 <= i < n else "" for i in map(int, ids)])

  @property
  def _skip_table(self) -> list[str]:
    """itos with pad and eos as "" (decode's skip_special)."""
    table = self.__dict__.get("_skip")
    if table is None:
      table = self.__dict__["_skip"] = [
          "" if i in (self.pad_id, self.eos_id) else s for i, s in enumerate(self.itos)
      ]
    return table


# Qwen2's pre-tokenization split (from its tokenizer.json).
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3 added tokens beyond Qwen2's three (ids from Qwen3's tokenizer_config.json).
QWEN3_EXTRA_TOKENS = {
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}


# Ends of a turn or a document (Qwen; Llama 3: <|eom_id|> ends a tool-call turn), besides eos.
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


class HFTokenizer:
  """A Hugging Face tokenizer folder: tokenizer.json, or vocab.json + merges.txt (Qwen BPE).

  Special tokens come from tokenizer_config.json's added_tokens_decoder / added_tokens.json;
  `add_qwen3_tokens=True` also adds Qwen3's <think>, </think>, tool tokens (151646-151668)
  when the folder only defines Qwen2's. eos = tokenizer_config's eos_token; stop ids = eos
  plus the STOP_TOKENS present. pad = pad_token, else <|endoftext|>, else eos (Llama 3 ships no
  pad token; the masks, not the pad id, mark padding).
  The chat template: chat_template.jinja, else tokenizer_config.json's chat_template.
  """

  def __init__(self, path: str, *, add_qwen3_tokens: bool = True):
    import tokenizers

    if not paths.isdir(path):
      raise FileNotFoundError(f"tokenizer folder {path!r} does not exist")
    folder = paths.path(path)
    tj, vocab, merges = folder / "tokenizer.json", folder / "vocab.json", folder / "merges.txt"
    if tj.exists():
      self._tok = tokenizers.Tokenizer.from_str(tj.read_text(encoding="utf-8"))
    elif vocab.exists() and merges.exists():
      self._tok = _bpe_from_files(paths.local_copy(vocab), paths.local_copy(merges))
    else:
      raise FileNotFoundError(f"{path}: no tokenizer.json and no vocab.json + merges.txt")
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    added = {
        v["content"]: int(k) for k, v in tokenizer_config.get("added_tokens_decoder", {}).items()
    }
    added.update(_read_json(folder / "added_tokens.json"))
    if add_qwen3_tokens and "<|im_start|>" in added:
      for tok, i in QWEN3_EXTRA_TOKENS.items():
        added.setdefault(tok, i)
    self._add_specials(added)
    self.special_ids = {self._tok.token_to_id(t) for t in added}
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    eos = _token_str(tokenizer_config.get("eos_token")) or "<|endoftext|>"
    pad = _token_str(tokenizer_config.get("pad_token")) or (
        "<|endoftext|>" if self._tok.token_to_id("<|endoftext|>") is not None else eos
    )
    self.eos_id = self._id(eos)
    self.pad_id = self._id(pad)
    stops = [self.eos_id] + [self._tok.token_to_id(t) for t in STOP_TOKENS]
    self.stop_ids = tuple(dict.fromkeys(i for i in stops if i is not None))
    self.path = path
    self.chat_template = chat_template_lib.read(path, tokenizer_config)
    self.special_tokens = chat_template_lib.special_tokens(
        tokenizer_config, _read_json(folder / "special_tokens_map.json")
    )

  def _add_specials(self, added: dict[str, int]):
    import tokenizers

    for content, want in sorted(added.items(), key=lambda kv: kv[1]):
      have = self._tok.token_to_id(content)
      if have is None:
        n = self._tok.get_vocab_size(with_added_tokens=True)
        if n != want:
          raise ValueError(f"special token {content!r} should have id {want} but would get {n}")
        self._tok.add_special_tokens(
            [tokenizers.AddedToken(content, special=True, normalized=False)]
        )
      elif have != want:
        raise ValueError(f"special token {content!r} has id {have}, config says {want}")

  def _id(self, token: str) -> int:
    i = self._tok.token_to_id(token)
    if i is None:
      raise ValueError(f"token {token!r} is not in the tokenizer's vocabulary")
    return i

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    ids = [int(i) for i in ids]
    if skip_special:
      ids = [i for i in ids if i not in self.special_ids]
    return self._tok.decode(ids, skip_special_tokens=False)


def _bpe_from_files(vocab: str, merges: str):
  import tokenizers
  from tokenizers import decoders
  from tokenizers import models
  from tokenizers import normalizers
  from tokenizers import pre_tokenizers

  tok = tokenizers.Tokenizer(
      models.BPE.from_file(vocab, merges, fuse_unk=False, byte_fallback=False)
  )
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence(
      [
          pre_tokenizers.Split(tokenizers.Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
  )
  tok.decoder = decoders.ByteLevel()
  return tok


def _read_json(path) -> dict:
  if not paths.exists(path):
    return {}
  try:
    return json.loads(paths.read_text(path))
  except (ValueError, UnicodeDecodeError) as e:
    raise ValueError(
        f"{path}: not valid JSON ({e}). Fix: repair or delete the file (it is " "optional)"
    ) from None


def _token_str(tok) -> str | None:
  if isinstance(tok, dict):
    return tok.get("content")
  return tok


def folder_chat_template(path: str) -> str | None:
  """The chat template of a tokenizer folder without building the tokenizer (validation)."""
  return chat_template_lib.read(path, _read_json(paths.path(path) / "tokenizer_config.json"))


# tokenizer.kind -> constructor from a folder path (the char tokenizer needs none).
KINDS = {
    "char": lambda path: CharTokenizer(),
    "char_tools": lambda path: CharTokenizer(CHAR_TOOL_SPECIALS, CHAR_TOOL_ALPHABET),
    "hf": lambda path: HFTokenizer(path),
}


def build_tokenizer(kind: str, path: str = "") -> Tokenizer:
  if kind not in KINDS:
    raise ValueError(f"unknown tokenizer kind {kind!r}; known: {', '.join(KINDS)}")
  return KINDS[kind](path)


# ------------------------------------------------------------------------------ export

# A source folder's files that an exported folder carries as they are; tokenizer.json and
# tokenizer_config.json are written from the tokenizer itself (its added tokens included).
_CARRIED_FILES = ("special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


def save_hf_folder(tok: Tokenizer, path: str) -> None:
  """Writes `tok` as a Hugging Face tokenizer folder at `path` (tokenizer.json and
  tokenizer_config.json, plus an HF folder's other files) that `transformers.AutoTokenizer.
  from_pretrained(path)` and `HFTokenizer(path)` load to encode text to the same ids, with the
  same eos and pad (for an export beside the policy's weights: infer's --export_hf).

  The char tokenizer becomes a word-level `tokenizers` model over single characters with its
  special tokens atomic (`<answer>` one id); `<pad>` and `<eos>` are the special ones, so
  `decode(ids, skip_special_tokens=True)` equals our `decode(ids)`. An HF tokenizer keeps its
  folder's files; the added tokens are all listed in tokenizer_config.json, since transformers
  builds Qwen's tokenizer from vocab.json + merges.txt and that file (Qwen3's <think> tokens that
  `HFTokenizer` adds to a Qwen2 folder would otherwise split into characters).
  """
  if isinstance(tok, CharTokenizer):
    backend = _char_backend(tok)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,  # " ." stays " ." as in our decode
    }
  elif isinstance(tok, HFTokenizer):
    backend = tok._tok
    source = paths.path(tok.path)
    tokenizer_config = _read_json(source / "tokenizer_config.json")
  else:
    raise TypeError(f"no Hugging Face form for a {type(tok).__name__}")
  out = paths.path(path)
  paths.makedirs(out)
  if isinstance(tok, HFTokenizer):
    for name in _CARRIED_FILES:
      if paths.exists(source / name):
        paths.write_atomic(out / name, paths.read_bytes(source / name))
  added = backend.get_added_tokens_decoder()
  tokenizer_config.update(
      added_tokens_decoder={str(i): _added_token_dict(t) for i, t in sorted(added.items())},
      eos_token=backend.id_to_token(tok.eos_id),
      pad_token=backend.id_to_token(tok.pad_id),
  )
  paths.write_atomic(out / "tokenizer.json", backend.to_str())
  paths.write_atomic(out / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2))


def _char_backend(tok: CharTokenizer):
  """The char tokenizer as a `tokenizers.Tokenizer`: one id per character, specials atomic."""
  import tokenizers
  from tokenizers import decoders
  from tokenizers import models
  from tokenizers import pre_tokenizers

  # No unknown token, as ours: a character outside the alphabet fails to encode.
  backend = tokenizers.Tokenizer(models.WordLevel(vocab=dict(tok.stoi), unk_token=None))
  backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
  backend.decoder = decoders.Fuse()  # characters joined as they are (no spaces between)
  skipped = (tok.pad_id, tok.eos_id)
  backend.add_tokens(
      [
          tokenizers.AddedToken(s, special=tok.stoi[s] in skipped, normalized=False)
          for s in tok.specials
      ]
  )
  return backend


def _added_token_dict(t) -> dict:
  """An AddedToken as tokenizer_config.json's added_tokens_decoder writes it."""
  keys = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
  return {k: getattr(t, k) for k in keys}
