"""Training on GPUs (marker gpu; skipped without one): what the CPU tests cannot show.

- Repeatability: the same train steps twice on one GPU give bitwise-equal losses and parameters (XLA's
  GPU scatter-add, e.g. the embedding gradient, may use float atomics; this test says whether the
  step as compiled is deterministic).
- Issue 4, item 5: a few train steps of a small MH-LatentMoE model under Head Parallel (hp = 2) and a
  small MoE model under Expert Parallel (ep = 2, ragged_all_to_all) give the same losses as on one GPU
  (fp32, highest matmul precision): bench/determinism.py --devices 2 as a test. Needs 2 GPUs.
The CPU equivalence tests with 8 host devices are in tests/parallel/test_parallel.py."""

import jax
import numpy as np
import pytest


def gpus() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


@pytest.mark.gpu
@pytest.mark.parametrize("kernels,attention,dtype", [("reference", "xla", "float32"),
                                                     ("reference", "cudnn", "bfloat16"),
                                                     ("triton", "cudnn", "bfloat16"),
                                                     ("triton", "triton", "bfloat16")])
def test_train_steps_bitwise_repeatable_on_one_gpu(kernels, attention, dtype):
    """Compiled as train.py compiles it (no XLA exclude-nondeterministic option: determinism by
    construction), the same steps twice give the same losses to the bit."""
    from bench.determinism import ACCUM, BATCH, SEQ, small_config, train_losses

    batch = np.random.default_rng(1).integers(0, 512, (ACCUM, BATCH, SEQ + 1), dtype=np.int32)
    batches = np.broadcast_to(batch, (3,) + batch.shape)
    for kind in ("mh_latent_moe", "moe"):
        cfg = small_config(kind, 1, kernels=kernels, attention=attention, dtype=dtype)
        runs = [train_losses(cfg, jax.devices()[:1], batches)[0] for _ in range(2)]
        assert runs[0] == runs[1], (kind, runs)


@pytest.mark.gpu
def test_step_context_bitwise_on_one_gpu(monkeypatch):
    """The Triton MH-LatentMoE step (bf16, fp32 masters) with its step context (the expert weights cast once per step,
    the gradients of the expert weights summed in place) gives bitwise the losses and gradient norms of the step
    without one, which casts them in every micro-batch and adds the gradients in XLA."""
    import mhl_jax.train.step as step_mod
    from bench.determinism import ACCUM, BATCH, SEQ, small_config, train_losses
    from mhl_jax.moe.context import StepContext

    batches = np.random.default_rng(2).integers(0, 512, (3, ACCUM, BATCH, SEQ + 1), dtype=np.int32)
    cfg = small_config("mh_latent_moe", 1, kernels="triton", attention="cudnn", dtype="bfloat16")
    runs = []
    for build in (step_mod.build_step_context, lambda model, accumulate=False: StepContext()):
        monkeypatch.setattr(step_mod, "build_step_context", build)
        norms = []
        runs.append((train_losses(cfg, jax.devices()[:1], batches, grad_norms=norms)[0], norms))
    assert runs[0] == runs[1], runs


@pytest.mark.gpu
@pytest.mark.skipif(gpus() < 2, reason="needs 2 GPUs")
def test_two_gpu_losses_equal_one_gpu():
    from bench.determinism import one_vs_two_devices as run

    records = run(steps=5, tol=1e-4, log=lambda line: None)  # raises naming the model on a mismatch
    assert {r["kind"] for r in records} == {"mh_latent_moe", "moe"}
    assert all(r["max_abs_diff"] <= 1e-4 for r in records)
