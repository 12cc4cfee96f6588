"""Probe (temporary): the weights' cast on a side stream vs in line, layer fwd+bwd, same process."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mhl_jax.model.moe_core as mc  # noqa: E402
import mhl_jax.ops.experts_triton as et  # noqa: E402
from bench.profile_layer import jax_trace  # noqa: E402

for tokens, config in [(81920, "384/4/256"), (81920, "1536/8/128")]:
    for side in (1, 0):
        et.SIDE_STREAM = side
        mc.GROUP = side
        try:
            hlo = os.path.join(os.environ.get("OUT", "/tmp"), f"hlo-{tokens}-{side}.txt") if config == "384/4/256" else None
            kernels, timing, lines, _ = jax_trace(tokens, config, "default", 5, hlo)
            conv = [round(ms, 3) for n, ms in kernels if "convert" in n and ms > 0.05]
            print(json.dumps(dict(tokens=tokens, config=config, side=side, layer_ms=round(timing["layer_ms"], 4),
                                  busy=round(timing["busy_ms"], 4), span=round(timing["span_ms"], 4),
                                  sum=round(sum(ms for _, ms in kernels), 4), conv=conv, lines=lines)), flush=True)
        except Exception as e:  # noqa: BLE001
            print(json.dumps(dict(tokens=tokens, config=config, side=side, error=f"{type(e).__name__}: {e}"[:800])),
                  flush=True)
