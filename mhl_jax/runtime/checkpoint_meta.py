"""A checkpoint's meta item against the run restoring it: the model fingerprint (the config a checkpoint must agree
on) and the table of leaves, checked before any array is read so that a checkpoint of another model or state layout
is refused naming what differs."""

from __future__ import annotations

from typing import Any

from mhl_jax.config import Config, config_to_dict
from mhl_jax.runtime.checkpoint_tree import changed_leaves, describe
from mhl_jax.runtime.errors import CheckpointError

# the FFN keys each kind builds its layers from (mhl_jax/model/gpt.py make_ffn): a key the kind ignores must not
# refuse a resume, nor crowd the keys that differ out of a mismatch's message
_FFN_KEYS = {
    "mlp": ("hidden", "stem_layers", "stem_hidden"),
    "moe": ("stem_layers", "stem_hidden", "num_experts", "top_k", "expert_hidden"),
    "latent_moe": ("stem_layers", "stem_hidden", "num_experts", "top_k", "expert_hidden", "latent_dim"),
    "mh_latent_moe": ("stem_layers", "stem_hidden", "num_experts", "top_k", "expert_hidden", "latent_dim",
                      "num_heads", "head_dim", "routing_tokens"),
}


def model_fingerprint(cfg: Config) -> dict:
    """What a checkpoint must agree on to be restored into this run: the model config and the FFN keys of its kind,
    less the settings that change how it runs (kernels, attention implementation, compute dtype, remat) or trains
    (balance_gamma). A checkpoint's fingerprint is compared on these keys only (`check_meta`), so one written with
    more keys still restores."""
    d = config_to_dict(cfg)
    keys = [k for k in _FFN_KEYS[cfg.ffn.kind] if not (k == "stem_hidden" and cfg.ffn.stem_layers == 0)]
    ffn = {k: d["ffn"][k] for k in ["kind", *keys]}
    model = {k: v for k, v in d["model"].items() if k not in ("attention_impl", "compute_dtype", "remat")}
    return {"model": model, "ffn": ffn}


def check_meta(meta: dict, fmt: int, fingerprint: dict, named: list[tuple[tuple[str, ...], Any]], where: str,
               partial: bool = False) -> None:
    """A checkpoint's meta item against the run restoring it: its layout version against `fmt`, its fingerprint (the
    model config) and its table of leaves against `named` (`partial`: named may be a part of the saved leaves).
    CheckpointError naming what differs."""
    if meta.get("format") != fmt:
        raise CheckpointError(f"checkpoint {where}: layout version {meta.get('format')!r}, expected {fmt}")
    # an FFN key this run's fingerprint leaves out (one its kind ignores) does not matter to it
    diff = [d for d in changed_leaves(meta.get("fingerprint", {}), fingerprint)
            if not (d[2] == "<absent>" and d[0].startswith("ffn."))]
    if diff:
        lines = "; ".join(f"{k}: checkpoint {theirs!r}, this run {ours!r}" for k, theirs, ours in diff)
        raise CheckpointError(f"checkpoint {where} was written by a different model config ({lines})")
    saved = {tuple(names): (shape, dtype) for names, shape, dtype in meta["leaves"]}
    wanted = {names: tuple(describe(leaf)) for names, leaf in named}
    missing = [n for n in wanted if n not in saved]
    extra = [] if partial else [n for n in saved if n not in wanted]
    if missing or extra:
        show = lambda ns: ", ".join("/".join(n) for n in ns[:4]) + (" ..." if len(ns) > 4 else "")
        raise CheckpointError(f"checkpoint {where} holds a different state layout: "
                              f"{len(missing)} leaves missing from it ({show(missing)}), "
                              f"{len(extra)} not in this run ({show(extra)})")
    for names, (shape, dtype) in wanted.items():
        if [list(saved[names][0]), saved[names][1]] != [shape, dtype]:
            hint = (f" (the optimizer's moments: set optimizer.moment_dtype={saved[names][1]} as the run that "
                    "wrote it had)" if names[0] == "opt_state" and list(saved[names][0]) == list(shape)
                    and {saved[names][1], dtype} == {"float32", "bfloat16"} else "")
            raise CheckpointError(f"checkpoint {where}: leaf {'/'.join(names)} is {saved[names][1]}"
                                  f"{tuple(saved[names][0])}, this run expects {dtype}{tuple(shape)}{hint}")
