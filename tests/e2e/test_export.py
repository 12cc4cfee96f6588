"""python -m mhl_jax.export: a checkpoint's weights as safetensors with the plain PyTorch module beside them, whose
logits are the model's own (the whole model across frameworks: attention, RoPE, norms, the dense MLP and each MoE
variant's routing and experts, written again in torch)."""

import importlib.util
import json

import numpy as np
import pytest
from flax import nnx

from mhl_jax.export import main as export_main
from tests.saved import saved_random_run

torch = pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")


@pytest.mark.parametrize("kind, sets", [("mlp", ()), ("moe", ()), ("latent_moe", ()), ("mh_latent_moe", ()),
                                        ("mh_latent_moe", ("ffn.routing_tokens=separate",))])
def test_exported_torch_module_gives_the_models_logits(tmp_path, kind, sets, capsys):
    run, model, cfg = saved_random_run(tmp_path, kind, *sets)
    out = tmp_path / "exported"
    assert export_main([str(run), "--out", str(out)]) == 0
    assert f"exported step 3 of {run}" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "modeling.py"]
    assert json.loads((out / "config.json").read_text())["step"] == 3

    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (3, cfg.model.context))
    want = np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, tokens))
    # the copy in the export directory, imported as a user would, with nothing of mhl_jax
    spec = importlib.util.spec_from_file_location(f"modeling_{kind}_{len(sets)}", out / "modeling.py")
    modeling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(modeling)
    got = modeling.load(out)(torch.from_numpy(tokens)).numpy()
    assert got.shape == want.shape == (3, cfg.model.context, cfg.model.vocab_size)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert "mhl_jax" not in (out / "modeling.py").read_text().split('"""', 2)[2]  # self-contained below its docstring


def test_an_export_that_fails_leaves_no_directory(tmp_path, monkeypatch):
    """A write that fails part-way (a full disk) leaves neither --out nor the temporary directory it was written in
    (refusals of bad arguments: the bad-input catalogue)."""
    run, _, _ = saved_random_run(tmp_path, "mh_latent_moe")

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors_numpy, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        export_main([str(run), "--out", str(tmp_path / "new")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mh_latent_moe"]
