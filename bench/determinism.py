"""Run-to-run determinism of the train step on one device: the same steps twice in this process and
(compare the printed lines of two invocations) across processes.

    python bench/determinism.py [--kinds mh_latent_moe moe] [--kernels reference triton]
                                [--options default fast none] [--attention xla cudnn] [--dtype float32]
                                [--steps 3] [--out FILE]

options: `default` = `jit_train_step`'s options (all-reduce code motion off); `xladet` = the same plus
xla_gpu_exclude_nondeterministic_ops (train.xla_deterministic_ops, XLA's deterministic scatter,
autotuning kept); `none` = no compiler options.
One JSON line per (kind, kernels, options): the losses of both in-process runs as float32 bit patterns
(hex) and whether they are equal. The small fp32 models of bench/train_2gpu.py, one random batch.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.timing import emit  # noqa: E402
from bench.train_2gpu import ACCUM, BATCH, SEQ, small_config, train_losses  # noqa: E402
from mhl_jax.train.step import train_step_compiler_options  # noqa: E402

OPTIONS = {"default": None, "xladet": train_step_compiler_options(deterministic=True), "none": {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["mh_latent_moe", "moe"])
    ap.add_argument("--kernels", nargs="+", default=["reference"])
    ap.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    ap.add_argument("--attention", nargs="+", default=["xla"], choices=["xla", "cudnn"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype (cudnn: bf16)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    outf = open(args.out, "a") if args.out else None
    batch = np.random.default_rng(1).integers(0, 512, (ACCUM, BATCH, SEQ + 1), dtype=np.int32)
    batches = np.broadcast_to(batch, (args.steps,) + batch.shape)
    for kind in args.kinds:
        for kernels, attention, opt in itertools.product(args.kernels, args.attention, args.options):
            cfg = small_config(kind, 1, kernels=kernels, attention=attention, dtype=args.dtype)
            options = OPTIONS[opt]  # None: what train_losses / jit_train_step pick for this config
            shown = train_step_compiler_options(False, attention == "cudnn") if options is None else options
            rec = dict(bench="determinism", kind=kind, kernels=kernels, attention=attention, dtype=args.dtype,
                       options=opt, compiler_options=shown, device=jax.devices()[0].device_kind)
            try:
                runs = [train_losses(cfg, jax.devices()[:1], batches, options)[0] for _ in range(2)]
                rec["losses_hex"] = [[np.float32(v).tobytes().hex() for v in r] for r in runs]
                rec["losses"] = runs[0]
                rec["equal_in_process"] = runs[0] == runs[1]
            except Exception as e:  # noqa: BLE001 - recorded, the next case runs
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            emit(rec, outf)


if __name__ == "__main__":
    main()
