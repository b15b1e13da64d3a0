"""Small self-contained examples built on the GRPO math in `grpo_jax.rl`.

python -m grpo_jax.examples.mnist --data_dir=DIR --workdir=OUT   # GRPO-MNIST (mnist.py)
"""
