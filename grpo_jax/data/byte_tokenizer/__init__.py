"""A byte-level tokenizer folder shipped with the package: no download, any UTF-8 text.

    tokenizer.kind="hf", tokenizer.path=byte_tokenizer.PATH      (configs/tiny_your_data.py)

Ids 0-255 are the 256 byte values of the UTF-8 text (id == byte, GPT-2's byte-to-unicode map
with no merges), 256 is `<|endoftext|>` (eos and pad): 257 ids, so a from-scratch model's
embedding and head stay tiny and a CPU trains on text in any language or script, where the char
tokenizer's 88-character alphabet refuses curly quotes or accents. It is an ordinary Hugging
Face folder (tokenizer.json + tokenizer_config.json), so HFTokenizer, transformers'
AutoTokenizer and vLLM read it as they read any model's. A prompt costs one token per byte:
about 4x the tokens of a BPE vocabulary on English.

`write(folder)` makes the two files (this folder's were made by it).
"""

import json
import os

PATH = os.path.dirname(os.path.abspath(__file__))
EOS = "<|endoftext|>"
VOCAB_SIZE = 257  # 256 bytes + EOS


def byte_to_unicode() -> dict[int, str]:
  """GPT-2's printable stand-in for each byte (what a byte-level BPE vocabulary holds)."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
  printable += range(ord("®"), ord("ÿ") + 1)
  out, extra = {b: chr(b) for b in printable}, 0
  for b in range(256):
    if b not in out:
      out[b] = chr(256 + extra)
      extra += 1
  return out


def write(folder: str = PATH):
  """tokenizer.json (byte-level BPE, no merges, id == byte) and tokenizer_config.json."""
  import tokenizers
  from tokenizers import decoders
  from tokenizers import models
  from tokenizers import pre_tokenizers

  vocab = {ch: b for b, ch in byte_to_unicode().items()}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([tokenizers.AddedToken(EOS, special=True, normalized=False)])
  os.makedirs(folder, exist_ok=True)
  tok.save(os.path.join(folder, "tokenizer.json"))
  config = {
      "added_tokens_decoder": {
          "256": {
              "content": EOS,
              "lstrip": False,
              "normalized": False,
              "rstrip": False,
              "single_word": False,
              "special": True,
          }
      },
      "bos_token": None,
      "eos_token": EOS,
      "pad_token": EOS,
      "model_max_length": 1000000,
      "tokenizer_class": "PreTrainedTokenizerFast",
      "clean_up_tokenization_spaces": False,
  }
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)
    f.write("\n")
