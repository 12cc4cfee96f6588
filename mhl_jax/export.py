"""Export a run's weights for use outside JAX: safetensors, a config JSON and a plain PyTorch module.

    python -m mhl_jax.export RUN_DIR --out DIR [--step N | --checkpoint PATH] [--set key=value ...]

DIR gets `model.safetensors` (every parameter and balancing bias of the checkpoint, fp32 as trained, named by its
path in the model: `blocks.3.ffn.experts.w1`, `embed`, `head`, ...), `config.json` (what the PyTorch module needs,
and where the weights came from) and `modeling.py` (a copy of `mhl_jax/torch_model.py`: torch and safetensors only),
so that `from modeling import load; load(DIR)(tokens)` gives the model's logits on any machine with PyTorch.
DIR must be new or empty; it is written in a temporary directory beside it and renamed into place, so an export
that stops part-way leaves no DIR behind.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from flax import nnx

from mhl_jax.config import Config, ConfigError
from mhl_jax.runtime.errors import EXIT_BAD_INPUT, EXIT_OK, INPUT_ERRORS, input_error_line
from mhl_jax.runtime.restore import Loaded, load_run

# what mhl_jax/torch_model.py reads (it imports nothing of mhl_jax, so it names these files itself)
WEIGHTS, CONFIG, MODULE = "model.safetensors", "config.json", Path(__file__).with_name("torch_model.py")


def torch_config(cfg: Config) -> dict:
    """The model's shape as `mhl_jax.torch_model.GPT` reads it."""
    m, f = cfg.model, cfg.ffn
    return {"vocab_size": m.vocab_size, "d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads,
            "head_dim": m.head_dim, "rope_base": m.rope_base, "norm_eps": m.norm_eps, "ffn_kind": f.kind,
            "stem_layers": f.stem_layers if f.kind != "mlp" else m.n_layers, "top_k": f.top_k,
            "num_experts": f.num_experts, "expert_hidden": f.expert_hidden, "ffn_heads": f.num_heads,
            "ffn_head_dim": f.head_dim, "latent_dim": f.latent_dim, "routing_tokens": f.routing_tokens}


def named_arrays(loaded: Loaded) -> dict[str, np.ndarray]:
    """Every parameter and bias of the loaded checkpoint by its dotted path in the model, as host numpy arrays."""
    out = {}
    for part in (loaded.params, loaded.biases):
        for path, var in nnx.to_flat_state(part):
            out[".".join(str(p) for p in path)] = np.asarray(var.get_value())
    return out


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {str(out)!r} exists and is not an empty directory: export writes a new directory "
                          "(name another, or remove it)")


def export(loaded: Loaded, out: str | Path) -> Path:
    """Write `loaded`'s weights, config and PyTorch module to the new directory `out`."""
    from safetensors.numpy import save_file  # optional: the export's

    out = Path(out).expanduser()
    check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        save_file(named_arrays(loaded), str(tmp / WEIGHTS))
        meta = {"model": torch_config(loaded.cfg), "step": loaded.step, "run": loaded.cfg.logging.run_dir,
                "compute_dtype": loaded.cfg.model.compute_dtype}
        (tmp / CONFIG).write_text(json.dumps(meta, indent=1) + "\n")
        shutil.copyfile(MODULE, tmp / "modeling.py")
        if out.exists():
            out.rmdir()  # empty (check_out): replaced by the finished directory
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mhl_jax.export", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", metavar="RUN_DIR", help="a logging.run_dir written by train.py")
    ap.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) directory to write")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the latest)")
    ap.add_argument("--checkpoint", default=None, metavar="PATH", help="a checkpoint elsewhere (a step directory)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of the run's config.yaml (repeatable)")
    args = ap.parse_args(argv)
    try:
        check_out(Path(args.out).expanduser())  # before the checkpoint is read
        loaded = load_run(args.run_dir, args.overrides, args.step, args.checkpoint)
        out = export(loaded, args.out)
    except INPUT_ERRORS as e:
        print(input_error_line(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"exported step {loaded.step} of {args.run_dir} to {out}: {WEIGHTS}, {CONFIG}, "
          "modeling.py (from modeling import load; load(DIR)(tokens) -> logits)")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
