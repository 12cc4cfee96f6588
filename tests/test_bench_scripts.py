"""bench/train_scale.py on CPU host devices: fp32 losses agree across device counts; bad asks stop."""

import os

import jax
import pytest

from bench import train_scale

CFG = os.path.join(train_scale.ROOT, "configs", "")
SMALL = ["model.compute_dtype=float32", "model.n_layers=1", "ffn.stem_layers=0", "model.context=32",
         "train.global_batch=16"]  # one MoE layer: compiles in seconds


def test_train_scale_losses_agree_across_device_counts():
    emitted = []
    recs = train_scale.run([CFG + "tiny_mh_latent_moe.yaml", CFG + "tiny_moe.yaml"], [1, 2], steps=2,
                           overrides=SMALL, tol=1e-5, emit=emitted.append, log=lambda s: None)
    assert [(r["config"], r["devices"]) for r in emitted] == [
        ("tiny_mh_latent_moe", 1), ("tiny_mh_latent_moe", 2), ("tiny_moe", 1), ("tiny_moe", 2)]
    for r in recs:
        assert r["ok"], r
        assert r["loss_ref_devices"] == 1 and r["loss_max_rel_diff"] <= 1e-5
        assert r["mesh_shape"] == [1, r["devices"]] and r["accum"] == 16 // (4 * r["devices"])
        assert r["losses"][1] < r["losses"][0] and r["step_s"] > 0 and r["compile_s"] > 0
    assert "tiny_moe | 2 | data 1 x ep 2 | 16 (4 x 2)" in train_scale.table(recs)


def test_train_scale_refuses_more_devices_than_visible():
    with pytest.raises(SystemExit, match="only"):
        train_scale.run([CFG + "tiny_moe.yaml"], [len(jax.devices()) + 1], steps=2)
