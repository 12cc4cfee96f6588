"""The GPT model (Flax NNX) and its parts, one module per idea; the math lives in pure functions."""

from mhl_jax.model.gpt import GPT, build_model

__all__ = ["GPT", "build_model"]
