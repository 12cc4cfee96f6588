"""The benches on CPU, cheaply: each one imports and parses its command line, the small ones run at tiny shapes, and
the pieces with logic of their own (train_scale's loss check, the profile readers, the kernel report's compiles for
sm_90a) are checked against known answers."""

import json
import os
import sys
from pathlib import Path

import jax
import pytest

from bench import train_scale

ROOT = Path(__file__).resolve().parents[2]
CFG = os.path.join(ROOT, "configs", "")
SMALL = ["model.compute_dtype=float32", "model.n_layers=1", "ffn.stem_layers=0", "model.context=32",
         "train.global_batch=16"]  # one MoE layer: compiles in seconds
BENCHES = ["layer", "experts", "router", "a2a", "train_scale", "memory", "attention", "generate", "determinism",
           "fresh_runs", "multiprocess"]
TOOLS = ["profile_layer", "profile_stalls", "profile_sass", "kernel_report", "kernel_tiles", "wgmma_rates",
         "attention_tiles", "profile_router", "expert_bwd"]


@pytest.mark.parametrize("name", BENCHES + [f"tools.{t}" for t in TOOLS])
def test_bench_imports_and_its_command_line_parses(name, monkeypatch, capsys):
    """`python -m bench.NAME --help` in-process: the module imports without a GPU and prints its usage."""
    import importlib

    mod = importlib.import_module(f"bench.{name}")
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 0 and "usage" in capsys.readouterr().out


def _records(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_layer_runs_at_a_tiny_shape_with_the_reference_gradients_on_the_triton_path(tmp_path, emulated):
    """bench.layer on the Triton path at one tiny shape, the bindings swapped for their emulating stand-ins (CPU):
    one record with the table's fields, and its JSON line appended to --out; then the layer's gradients there
    (bench.layer's own functions, its compiles read back from the persistent compilation cache) equal those of the
    same layer on the reference ops. Guards the GPU runs, where a crash costs device time. (The reference ops take
    no branch of bench.layer's own: `impl` is handed to `moe_heads`.)"""
    import jax.numpy as jnp
    import numpy as np

    from bench import layer as bl

    tokens, ne, k, de = 48, 6, 2, 32
    out = tmp_path / "layer.jsonl"
    bl.main(["--tokens", str(tokens), "--configs", f"{ne}/{k}/{de}", "--impl", "triton", "--out", str(out)])
    (r,) = _records(out)
    assert r["bench"] == "layer" and r["impl"] == "triton" and "error" not in r, r
    assert r["params"] == dict(tokens=tokens, d=1024, nh=8, dh=128, ne=ne, k=k, de=de, expert_weights="float32",
                               routing="random")
    assert r["ms"] > 0 and r["ms_fwd"] > 0 and r["ms_stream"] > 0 and r["peak_gib"] > 0 and r["tflops"] > 0
    assert "authors" not in r

    x = jax.random.normal(jax.random.key(1), (tokens, bl.D)).astype(jnp.bfloat16)
    for collapse in (0, k):  # --routing collapsed: every token on experts 0 .. k-1 of each head
        params = bl.init_params(jax.random.key(0), ne, de, collapse)
        sub = jnp.dot(x, params["w_in"].astype(x.dtype)).reshape(tokens, bl.NH, bl.DH)
        scores = jnp.einsum("nhd,hde->nhe", sub.astype(jnp.float32), params["w_r"]) + params["bias"]
        picked = np.sort(np.asarray(jax.lax.top_k(scores, k)[1]), axis=-1)
        assert (picked == np.arange(k)).all() == bool(collapse)
        g_tri, g_ref = (bl.layer_fns(k, impl)[1](params, x)[0] for impl in ("triton", "reference"))
        for name in params:
            a, b = np.asarray(g_tri[name], np.float32), np.asarray(g_ref[name], np.float32)
            assert np.abs(a - b).max() <= 0.05 * np.abs(b).max() + 1e-12, name  # bf16 activations, two paths


def test_router_and_attention_run_at_tiny_shapes(tmp_path):
    """bench.router (the JAX reference router) and bench.attention (XLA's) at tiny shapes: a record each, no error."""
    from bench import attention, router

    router.main(["--tokens", "64", "--ne", "16", "--impls", "reference", "--out", str(tmp_path / "r.jsonl")])
    (r,) = _records(tmp_path / "r.jsonl")
    assert r["impl"] == "reference" and r["ms"] > 0 and r["ms_stream"] > 0 and r["ms_fwd_stream"] > 0, r
    assert r["peak_gib"] > 0, r
    attention.main(["--batch", "1", "--seq", "32", "--heads", "2", "--head-dim", "16", "--impls", "xla",
                    "--out", str(tmp_path / "a.jsonl")])
    (a,) = _records(tmp_path / "a.jsonl")
    assert a["impl"] == "xla" and a["fwd_bwd_ms"] > 0 and a["repeat_bitwise"] and max(a["rel_err"]) < 1e-2, a


def test_a2a_padded_exchange_runs_on_host_devices(tmp_path):
    """bench.a2a's HP and padded EP exchanges over the CPU host devices at a tiny shape: every exchange returned its
    input (checked inside), HP records per (k, skew) and one padded EP record."""
    from bench import a2a

    out = tmp_path / "a2a.jsonl"
    a2a.main(["--tokens", "16", "--d", "64", "--heads", "8", "--ks", "2", "--skews", "0", "--ep-impls", "padded",
              "--repeats", "2", "--unroll", "2", "--out", str(out)])
    recs = _records(out)
    assert {r["impl"] for r in recs} == {"hp", "hp_token_major", "ep_padded"}, recs
    assert all(r["ms"] > 0 and r["params"]["devices"] == len(jax.devices()) for r in recs)


def test_train_scale_losses_agree_across_device_counts():
    """One config on 1 and 2 devices (run largest first, emitted in order): the loss check, the records and the table.
    One config is enough: the bench runs every config alike, on the model axis the library picks (`model_axis`: hp
    here, ep for MoE), and both parallel modes are checked against one device in tests/parallel."""
    emitted = []
    recs = train_scale.run([CFG + "tiny_mh_latent_moe.yaml"], [1, 2], steps=2, overrides=SMALL, tol=1e-5,
                           emit=emitted.append, log=lambda s: None)
    assert [(r["config"], r["devices"]) for r in emitted] == [("tiny_mh_latent_moe", 1), ("tiny_mh_latent_moe", 2)]
    for r in recs:
        assert r["ok"], r
        assert r["loss_ref_devices"] == 1 and r["loss_max_rel_diff"] <= 1e-5
        assert r["mesh_shape"] == [1, r["devices"]] and r["accum"] == 16 // (4 * r["devices"])
        assert r["losses"][1] < r["losses"][0] and r["step_s"] > 0 and r["compile_s"] > 0
    assert "tiny_mh_latent_moe | 2 | data 1 x hp 2 | 16 (4 x 2)" in train_scale.table(recs)
    for r in recs:  # the last step's routing, per MoE layer of the config, and its empty groups in the table
        assert r["routing"] and all(v["groups"] > 0 and v["max_over_mean"] >= 1 and 0 < v["top4_share_min"] <= 1
                                    for v in r["routing"].values()), r["routing"]
        empty = [v["empty_groups"] for v in r["routing"].values()]
        groups = next(iter(r["routing"].values()))["groups"]
        assert f"| {min(empty)}-{max(empty)} of {groups} |" in train_scale.table([r])


def test_routing_summary_of_a_steps_loads():
    """bench.common.routing_summary: per layer the largest group over the mean, the empty groups and the least
    over the heads of the 4 busiest experts' share; a (Ne,) load is one head; no loads: None."""
    import numpy as np

    from bench.common import routing_summary

    loads = np.array([[10, 0, 0, 0, 0, 2], [3, 3, 3, 3, 0, 0]])  # 24 slots over 12 groups: mean 2
    got = routing_summary({"loss": 1.0, "loads/2": loads, "loads/3": np.array([5, 5, 0, 0, 0, 0, 0, 0])})
    assert got == {"2": dict(max_over_mean=5.0, empty_groups=6, groups=12, top4_share_min=1.0),
                   "3": dict(max_over_mean=4.0, empty_groups=6, groups=8, top4_share_min=1.0)}
    one = routing_summary({"loads/0": np.array([[4, 3, 2, 1, 0, 0, 0, 10]])})["0"]
    assert one["top4_share_min"] == round(19 / 20, 4) and one["max_over_mean"] == 4.0
    assert routing_summary({"loss": 1.0}) is None


def test_train_scale_refuses_more_devices_than_visible():
    with pytest.raises(SystemExit, match="only"):
        train_scale.run([CFG + "tiny_moe.yaml"], [len(jax.devices()) + 1], steps=2)


def test_profile_layer_reads_ncu_csv():
    """bench.tools.profile_layer: ncu's CSV (banner lines, units per row) -> kernel times in ms, names folded."""
    from bench.tools.profile_layer import parse, short

    text = "\n".join([
        "==PROF== Connected to process 1",
        '"ID","Process ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"',
        '"0","1","expert_dx_kernel","Command line profiler metrics","gpu__time_duration.sum","nsecond","2,015,168"',
        '"1","1","loop_add_fusion_3","Command line profiler metrics","gpu__time_duration.sum","usecond","348.1"',
        '"2","1","void cutlass::Kernel<T>(Params)","Command line profiler metrics","dram__bytes.sum","byte","9"',
    ])
    got = parse(text)
    assert [n for n, _ in got] == ["expert_dx_kernel", "loop_add_fusion_3"]
    assert abs(got[0][1] - 2.015168) < 1e-9 and abs(got[1][1] - 0.3481) < 1e-9
    assert short("loop_add_fusion_3") == "loop_add_fusion"
    assert short("void cutlass::Kernel<T>(Params)") == "void cutlass::Kernel"


def test_profile_layer_kills_a_slow_profile_and_its_children():
    """bench.tools.profile_layer's `run_group`: past the time limit the whole process group goes (ncu and the child it
    profiles: here a shell whose background child still holds the output pipe), what was printed comes back,
    returncode -1; a quick command returns as run."""
    import time

    from bench.tools.profile_layer import run_group

    t0 = time.monotonic()
    p = run_group(["bash", "-c", "echo partial; sleep 60 & sleep 60"], 1.0)
    assert p.returncode == -1 and p.stdout == "partial\n" and "timed out after 1 s" in p.stderr
    assert time.monotonic() - t0 < 20
    p = run_group(["bash", "-c", "echo done; exit 3"], 30.0)
    assert p.returncode == 3 and p.stdout == "done\n"


def test_kernel_report_counts_instructions_and_spills_per_partition():
    """bench.tools.kernel_report cuts cuobjdump's SASS at the register reconfigurations (the partitions of a
    warp-specialised kernel, named by their setmaxnreg kind and count) and counts each one's instructions and spill
    loads / stores; lines that are not instructions do not count."""
    from bench.tools.kernel_report import sass_partitions

    pad = " " * 19
    sass = "\n".join(["        code for sm_90a", f"        /*0000*/{pad}LDC R1, c[0x0][0x28] ;",
                      f"        /*0010*/{pad}USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xd0 ;",
                      f"        /*0020*/{pad}STL [R1+0x4], R2 ;", f"        /*0030*/{pad}FFMA R2, R3, R4, R5 ;",
                      f"        /*0040*/{pad}USETMAXREG.DEALLOC.CTAPOOL 0x40 ;",
                      f"        /*0050*/{pad}LDL R2, [R1+0x4] ;", f"        {pad}{pad}/* 0x0 */"])
    assert sass_partitions(sass) == [dict(name="setup", instructions=1, spill_instructions=0),
                                     dict(name="try_alloc 208", instructions=3, spill_instructions=1),
                                     dict(name="dealloc 64", instructions=2, spill_instructions=1)]


def test_profile_stalls_reads_ncu_csv():
    """bench.tools.profile_stalls: per kernel, the metrics of its last launch (the first one compiles), durations
    in nanoseconds whatever the row's unit."""
    from bench.tools.profile_stalls import parse

    head = '"ID","Process ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"'
    stall = "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"
    rows = [(0, "expert_fwd_kernel", "gpu__time_duration.sum", "msecond", "9"),
            (1, "expert_fwd_kernel", "gpu__time_duration.sum", "usecond", "1,044.5"),
            (1, "expert_fwd_kernel", stall, "", "1.14"),
            (2, "router_fwd_kernel(int)", "gpu__time_duration.sum", "nsecond", "978,208")]
    lines = [head] + [f'"{i}","1","{k}","s","{m}","{u}","{v}"' for i, k, m, u, v in rows]
    text = "==PROF== Connected\n" + "\n".join(lines)
    got = parse(text)
    assert set(got) == {"expert_fwd_kernel", "router_fwd_kernel"}
    assert got["expert_fwd_kernel"] == {"gpu__time_duration.sum": 1044500.0, stall: 1.14}
    assert got["router_fwd_kernel"]["gpu__time_duration.sum"] == 978208.0


def _kernel_report(tmp_path, *args) -> list[dict]:
    """bench.tools.kernel_report run in a subprocess (compiled, not interpreted; a Triton cache folder of its own:
    importing jax-triton elsewhere in this process may have set it to "") -> its records."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    out = tmp_path / "report.jsonl"
    p = subprocess.run([sys.executable, "-m", "bench.tools.kernel_report", *args, "--out", str(out)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("ne,k,warps,regs,limit", [(384, 4, 16, 152, 128), (768, 8, 12, 200, 168)])
def test_gluon_router_compiles_warp_specialised(tmp_path, ne, k, warps, regs, limit):
    """bench.tools.kernel_report compiles the warp-specialised Gluon router forward (kernels/gluon/router.py) for sm_90a
    as the JAX binding does (no GPU): a producer and three consumer warp groups at k <= 4 (two above), the PTX
    requiring all of their threads, compiled at the launch limit of that consumer count (the kernel object
    `ws_router_kernel` picks), the workers' registers set by setmaxnreg, wgmma, at most a few spilled words
    (two at k 4, where three consumers hold 152 registers each; none at k 8), within the 227 KB of shared memory."""
    pytest.importorskip("triton")
    (r,) = _kernel_report(tmp_path, "--tiles", "router_ws", "--de", str(ne), "--k", str(k))
    assert r["kernel"] == "router_ws" and r["warp_specialized"], r
    assert r["launch_warps"] == warps and r["reqntid"] == [32 * warps] and r["registers"] == limit, r
    assert {regs, 40} <= set(r["setmaxnreg"]) and r["spill_store_bytes"] <= 16, r
    assert not r["wgmma_serialized"], r  # ptxas keeps the wgmma pipeline (C7512 would serialise every k-step)
    assert r["sass_counts"]["HGMMA"] > 0 and r["shared_bytes"] <= 227 * 1024, r


def test_gluon_router_with_caster_compiles(tmp_path):
    """The router forward with the caster warp group (two consumers, a producer, the caster: four warp groups in
    64K registers, launch limit 128) compiles for sm_90a: setmaxnreg gives the workers 200 / 40 / 40 and the default
    consumer 232, the consumers keep their wgmma pipeline and spill nothing (the producer may spill an instruction
    or so)."""
    pytest.importorskip("triton")
    (r,) = _kernel_report(tmp_path, "--tiles", "router_ws_cast", "--de", "1536", "--k", "8")
    assert r["kernel"] == "router_ws_cast" and r["warp_specialized"], r
    assert r["launch_warps"] == 16 and r["reqntid"] == [512] and r["registers"] == 128, r
    assert {232, 200, 40} <= set(r["setmaxnreg"]) and not r["wgmma_serialized"], r
    consumers = [q for q in r["sass_partitions"] if q["instructions"] > 1000]  # the two selection loops
    assert len(consumers) == 2 and all(q["spill_instructions"] == 0 for q in consumers), r["sass_partitions"]


@pytest.mark.parametrize("ne,k,de,dw_spill", [(384, 4, 256, 64), (768, 8, 128, 512)])
def test_default_expert_tiles_compile_for_hopper_without_spills(tmp_path, ne, k, de, dw_spill):
    """bench.tools.kernel_report compiles the expert kernels at their 81920-token default tiles for sm_90a
    with the Triton wheel's ptxas (no GPU): wgmma (HGMMA) is used, and the registers hold the tiles (the
    fwd and dX kernels spill nothing, the dW kernel at most a few words; at de 128 the dW kernel is the fused
    backward with the gate gradients, which spills a few hundred bytes)."""
    pytest.importorskip("triton")
    from kernels.tuning import default_config

    cfg = default_config(81920 * 8 * k, 8 * ne, 128, de)
    tiles = [f"{kind},{t.block_m},{t.block_e},{t.num_warps},{t.num_stages}"
             for kind, t in (("fwd", cfg.fwd), ("dx", cfg.dx), ("dwt", cfg.dw))]
    assert cfg.fwd_ws  # these shapes run the warp-specialised Gluon forward on Hopper (the Triton one elsewhere)
    tiles.append("fwd_ws")
    # the Gluon dW kernel (the split backward's at the 8192-token rows; not chosen at these, compiled all the same)
    if de == 256:  # and the Gluon backward with the dX warp group (these rows' backward)
        assert cfg.bwd_ws and cfg.bwd_xw
        tiles += ["dw_ws", "bwd_xw"]
    else:  # and the fused Gluon backward (the 8192-token rows' at de 128)
        tiles.append("bwd_ws")
    recs = {r["kernel"]: r for r in _kernel_report(tmp_path, "--tiles", *tiles, "--de", str(de))}
    assert set(recs) == {"fwd", "dx", "dwt", "fwd_ws"} | ({"dw_ws", "bwd_xw"} if de == 256 else {"bwd_ws"})
    for r in recs.values():
        assert r["sass_counts"]["HGMMA"] > 0 and r["registers"] <= 255, r
    for kind in {"fwd_ws", "bwd_xw", "bwd_ws", "dw_ws"} & set(recs):  # the Gluon kernels keep the wgmma pipeline
        # (ptxas C7512 "wgmma.mma_async instructions are serialized": each k-step waits for the one before)
        assert not recs[kind]["wgmma_serialized"], recs[kind]
    assert recs["fwd"]["spill_store_bytes"] == 0 and recs["dx"]["spill_store_bytes"] == 0, recs
    # the Gluon forward as the JAX binding compiles it (mhl_jax.moe.gpu.gluon): three warp groups under the
    # launch limit of 168 registers, the consumers raised to 208 and the producer lowered to 88, no spill
    ws = recs["fwd_ws"]
    assert ws["warp_specialized"] and ws["registers"] <= 168 and ws["spill_store_bytes"] == 0, ws
    assert 208 in ws["setmaxnreg"] and 88 in ws["setmaxnreg"], ws["setmaxnreg"]
    # launched with all three warp groups: the PTX requires exactly 384 threads (jax-triton alone would launch 128)
    assert ws["launch_warps"] == 12 and ws["reqntid"] == [384], ws
    assert recs["dwt"]["spill_store_bytes"] <= dw_spill, recs["dwt"]
    if de == 256:  # the worker consumer raised to 240 registers, the default-partition one to 232 (both dW
        # accumulators of 64 de: 128), the producer lowered to 32; ptxas allocates each partition's code at its
        # setmaxnreg count (64-row blocks, or the worker at 208, spill ten times as much)
        dw = recs["dw_ws"]
        assert dw["warp_specialized"] and dw["launch_warps"] == 12 and dw["reqntid"] == [384], dw
        assert {240, 232, 32} <= set(dw["setmaxnreg"]) and dw["spill_store_bytes"] <= 64, dw
        # four warp groups (launch limit 128 registers): consumers at 208 (the default partition gets 512 - the
        # workers' 304), producer 32, dX warp group 64 (a few spilled instructions in the block loops); with the dX
        # warp group at 56, or dW2's product in flight across the block loop, ptxas serialises every wgmma of the
        # kernel (C7512), which costs ~14% of the kernel's time
        xw = recs["bwd_xw"]
        assert xw["warp_specialized"] and xw["launch_warps"] == 16 and xw["reqntid"] == [512], xw
        assert {208, 32, 64} <= set(xw["setmaxnreg"]) and xw["registers"] <= 128, xw
        assert xw["spill_store_bytes"] <= 192 and xw["shared_bytes"] <= 227 * 1024, xw
        # per partition: the dX warp group's code at 64 registers spills a few address words in its block loop and
        # in its walk of the schedule's items (20 spilled instructions at sm_90a); with more work in its block
        # loop, more spills and a slower kernel
        parts = {p["name"]: p for p in xw["sass_partitions"]}
        assert sum(p["instructions"] for p in xw["sass_partitions"]) == xw["sass_instructions"], xw
        assert {"try_alloc 208", "dealloc 64", "dealloc 32"} <= set(parts), parts
        assert parts["dealloc 64"]["spill_instructions"] <= 24, parts
    else:  # the fused backward: the dW kernel's partitions (consumers 232 / 232, producer 40), plus dX and the gate
        # gradients (a few spilled words; more with the gate-gradient half made after dW2's product is issued)
        bwd = recs["bwd_ws"]
        assert bwd["warp_specialized"] and bwd["launch_warps"] == 12 and bwd["reqntid"] == [384], bwd
        assert {232, 40} <= set(bwd["setmaxnreg"]) and bwd["spill_store_bytes"] <= 128, bwd
        assert bwd["shared_bytes"] <= 227 * 1024, bwd


def test_wgmma_rates_kernel_compiles_both_operand_forms():
    """bench.tools.wgmma_rates' kernel compiles for sm_90a (no GPU) to the m64n32k16 wgmma with A from shared memory
    (SS) and, with A_REG, from registers (RS: one register operand more), without spills; the rates themselves are a
    GPU measurement."""
    pytest.importorskip("triton")
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    code = ("import json; from bench.tools.wgmma_rates import compile_case; "
            "print(json.dumps([compile_case(32, 64, 1, a) for a in (0, 1)]))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    ss, rs = json.loads(p.stdout.splitlines()[-1])
    for r in (ss, rs):
        assert r["hgmma_count"] > 0 and all(f.startswith("HGMMA.64x32x16.F32.BF16") for f in r["hgmma"]), r
        assert not r["spills"], r
    ops = [max(f.count("_") for f in r["hgmma"]) for r in (ss, rs)]
    assert ops[1] == ops[0] + 1, (ss["hgmma"], rs["hgmma"])


def test_gpu0_lines_reads_only_gpu_0s_lines(tmp_path, monkeypatch):
    """bench.tools.trace's `gpu0_lines` (read by profile_layer's trace): from the first .xplane.pb under the folder,
    the lines of the /device:GPU:0 plane only, events as (start, duration, name); nothing without a file."""
    from types import SimpleNamespace as NS

    import jax.profiler

    from bench.tools.trace import gpu0_lines

    assert gpu0_lines(str(tmp_path)) == (0, [])
    (tmp_path / "plugins" / "profile" / "r").mkdir(parents=True)
    (tmp_path / "plugins" / "profile" / "r" / "host.xplane.pb").write_bytes(b"")
    ev = lambda s, d, n: NS(start_ns=s, duration_ns=d, name=n)  # noqa: E731
    planes = [NS(name="/host:CPU", lines=[NS(name="python", events=[ev(1, 2, "host")])]),
              NS(name="/device:GPU:0", lines=[NS(name="Stream #1(Compute)", events=[ev(10, 5, "k1"), ev(20, 1, "k2")]),
                                              NS(name="XLA Ops", events=[ev(10, 5, "fusion")])]),
              NS(name="/device:GPU:1", lines=[NS(name="Stream #1(Compute)", events=[ev(3, 3, "other")])])]
    monkeypatch.setattr(jax.profiler.ProfileData, "from_file", staticmethod(lambda path: NS(planes=planes)))
    assert gpu0_lines(str(tmp_path)) == (1, [("Stream #1(Compute)", [(10, 5, "k1"), (20, 1, "k2")]),
                                             ("XLA Ops", [(10, 5, "fusion")])])
