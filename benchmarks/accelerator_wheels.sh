#!/usr/bin/env bash
# Fills .whl/ (the wheels the lent GPU machine lacks) and .gpudata/ (GSM8K + the Qwen tokenizer
# for benchmarks/accelerator.py's loop section), both ignored through .git/info/exclude, so a
# device run can carry them (`carry: [".whl", ".gpudata"]`). Run from anywhere:
#
#     bash benchmarks/accelerator_wheels.sh            # then see benchmarks/accelerator.py
#
# The GPU machine has jax 0.11.2 (+ CUDA 13 plugin), torch, transformers, optax, orbax, chex,
# etils, absl-py, safetensors, tokenizers, tensorstore, ...; no registry. The wheels below are
# pure Python or cp312 manylinux (versions of requirements/constraints.txt, flax 0.12.10: the
# release that runs on jax 0.11.2); every Requires-Dist of them is already on that machine.
# rouge-score has no wheel on PyPI: it is built here (pure Python).
#
# .whl_tunix/ (also ignored): Tunix for benchmarks/grpo_step.py's Tunix side (tunix_step.py),
# installed in a folder of its own on the Tunix process's PYTHONPATH (--tunix_path): google-tunix
# and the two packages its imports need that the machine and .whl/ lack, google-metrax
# (tunix.sft.metrics_logger) and clu (metrax's base); pure Python, about 0.7 MB. Tunix's other
# Requires-Dist are not imported on the learner's path (datasets, tensorflow_datasets, kagglehub,
# grain, qwix, omegaconf, ...) or are there already; perfetto (imported at `import tunix` by
# tunix.perf.perfetto, used only to write traces) is stubbed by tunix_step.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
DATA="${SHARED_DATA:-$ROOT/../shared/data}"

exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
for p in /.whl/ /.whl_tunix/ /.gpudata/; do
  grep -qxF "$p" "$exclude" 2>/dev/null || echo "$p" >>"$exclude"
done

rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl \
  flax==0.12.10 grain==0.2.18 array_record==0.8.6 ml_collections==1.1.0 tensorboardX==2.6.5 \
  nltk==3.10.4 optax==0.2.8 orbax-checkpoint==0.12.8 portpicker==1.6.0 defusedxml==0.7.1
"$PY" -m pip wheel -q --no-deps -w .whl rouge_score==0.1.2

rm -rf .whl_tunix && mkdir -p .whl_tunix
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform any -d .whl_tunix google-tunix==0.1.7 google-metrax==0.2.4 clu==0.0.12

rm -rf .gpudata && mkdir -p .gpudata/gsm8k .gpudata/qwen_tokenizer
cp "$DATA"/gsm8k/train.jsonl "$DATA"/gsm8k/test.jsonl .gpudata/gsm8k/
cp "$DATA"/qwen_tokenizer/* .gpudata/qwen_tokenizer/
chmod -R u+w .gpudata

ls -la .whl .whl_tunix
du -sh .whl .whl_tunix .gpudata
