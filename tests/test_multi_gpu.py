"""Two-GPU training equivalence (issue 4, item 5): bench/train_2gpu.py as a test.

A few train steps of a small MH-LatentMoE model under Head Parallel (hp = 2) and a small MoE model
under Expert Parallel (ep = 2, ragged_all_to_all) give the same losses as on one GPU (fp32, highest
matmul precision). Needs 2 GPUs: skipped otherwise (the CPU equivalence tests with 8 host devices are
in tests/test_parallel.py)."""

import jax
import pytest


def _gpus() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")
def test_two_gpu_losses_equal_one_gpu():
    from bench.train_2gpu import run

    records = run(steps=5, tol=1e-4, log=lambda line: None)  # raises naming the model on a mismatch
    assert {r["kind"] for r in records} == {"mh_latent_moe", "moe"}
    assert all(r["max_abs_diff"] <= 1e-4 for r in records)
