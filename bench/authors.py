"""The authors' released PyTorch MH-LatentMoE layer (Head Parallel on one rank), timed on this GPU beside ours:
`python -m bench.layer --authors DIR`, DIR holding their `src/` folder. Nothing of theirs is in this repository; their
modules are imported from DIR at run time. Needs torch with CUDA; their code also wants a process group (NCCL, one
rank) and a config module that needs pydantic (stood in for when pydantic is missing: the layer reads plain fields).
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import torch
import torch.distributed as dist

AUTHORS_LAYER = "model.modules.ffwd.mh_moe_hp_nrt"  # their module and class of the HP layer without replication
AUTHORS_CLASS = "MHMoEHPNRT"
D, NH, DH, T = 1024, 8, 128, 2048  # the layer table's width and heads; tokens = B x T


def cuda_ms(fn, warmup: int = 5, reps: int = 20) -> float:
    """Median ms of fn() between CUDA events, after warm-up calls (torch.compile inside their layer compiles there)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        ts.append(start.elapsed_time(end))
    return sorted(ts)[len(ts) // 2]


class AuthorsLayer:
    """Their layer class, imported once from DIR/src; `measure` builds and times it at one shape."""

    def __init__(self, folder: str):
        src = os.path.join(os.path.abspath(folder), "src")
        if not os.path.isdir(src):
            raise SystemExit(f"--authors {folder}: no src/ folder there")
        sys.path.insert(0, src)  # their modules import each other by top-level package names
        try:
            importlib.import_module("pydantic")
        except ImportError:
            template = types.ModuleType("config.config_template")
            template.ConfigTemplate = object
            sys.modules.setdefault("config", types.ModuleType("config"))
            sys.modules.setdefault("config.config_template", template)
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29511")
            dist.init_process_group("nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)
        self.cls = getattr(importlib.import_module(AUTHORS_LAYER), AUTHORS_CLASS)

    def measure(self, tokens: int, ne: int, k: int, de: int) -> dict:
        """{ms_fwd, ms, peak_gib} of their layer on `tokens` tokens (fp32 input of (tokens / T, T, d), as their
        training feeds it), or {error}."""
        cfg = types.SimpleNamespace(num_block=12, emb_size=D, ffwd_num_head=NH, ffwd_head_size=DH,
                                    ffwd_num_expert=ne, ffwd_num_expert_active=k, ffwd_expert_size=de,
                                    runtime={"auxfree_bias_all": torch.zeros(12, NH, ne, device="cuda")})
        try:
            mod = self.cls(cfg, idx_block=2).cuda()
            x = torch.randn(tokens // T, T, D, device="cuda", requires_grad=True)
            g = torch.randn(tokens // T, T, D, device="cuda")
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = {"ms_fwd": cuda_ms(lambda: mod(x)), "ms": cuda_ms(lambda: mod(x).backward(g))}
            out["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
            return out
        except Exception as e:  # their code at a shape it cannot run: recorded, ours still counts
            return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        finally:
            torch.cuda.empty_cache()
