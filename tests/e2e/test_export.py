"""python -m mhl_jax.export: a checkpoint's weights as safetensors with the plain PyTorch module beside them, whose
logits are the model's own (the whole model across frameworks: attention, RoPE, norms, the dense MLP and each MoE
variant's routing and experts, written again in torch)."""

import importlib.util
import json

import jax
import numpy as np
import pytest
from flax import nnx

from mhl_jax.config import dump_config, load_config
from mhl_jax.export import main as export_main
from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.gpt import build_model
from mhl_jax.runtime.checkpoint import Checkpointer, model_fingerprint
from tests.runs import ROOT

torch = pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")


def _saved_run(tmp_path, kind: str, *sets: str):
    """A run directory holding config.yaml and a checkpoint of step 3 of a freshly built 2-layer model (a dense stem
    layer, then the FFN of `kind`), its balancing biases random so that they change which experts are chosen."""
    run = tmp_path / kind
    cfg = load_config(str(ROOT / f"configs/tiny_{kind}.yaml"), [
        "model.n_layers=2", "model.context=32", "parallel.devices=1", f"logging.run_dir={run}", *sets])
    # random weights, drawn in numpy: building the model eagerly would compile each of its initialisers
    graphdef, params, biases = nnx.split(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param, RouterBias)
    rng = np.random.default_rng(1)

    def draw(part, scale):
        return jax.tree.map(lambda a: (scale * rng.standard_normal(a.shape)).astype(np.float32), part)

    params, biases = draw(params, 0.1), draw(biases, 0.05)
    state = {"params": params, "biases": biases, "step": np.int32(3)}
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(cfg))
    with Checkpointer(run / "checkpoints", cfg.checkpoint, model_fingerprint(cfg)) as ck:
        ck.save(3, state, None)
    return run, nnx.merge(graphdef, params, biases), cfg


@pytest.mark.parametrize("kind, sets", [("mlp", ()), ("moe", ()), ("latent_moe", ()), ("mh_latent_moe", ()),
                                        ("mh_latent_moe", ("ffn.routing_tokens=separate",))])
def test_exported_torch_module_gives_the_models_logits(tmp_path, kind, sets, capsys):
    run, model, cfg = _saved_run(tmp_path, kind, *sets)
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
    run, _, _ = _saved_run(tmp_path, "mh_latent_moe")

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors_numpy, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        export_main([str(run), "--out", str(tmp_path / "new")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mh_latent_moe"]
