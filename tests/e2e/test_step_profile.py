"""bench.step_profile on CPU: a tiny MH-LatentMoE train step's HLO split by the model's and the step's named scopes
(every part found, the expert FFN's backward marked as such, the floors' FLOPs equal to the HLO's dots), the CPU's
own trace read back through the same code a GPU's goes through, and collectives classed by opcode on a 2-device
Head Parallel mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from bench import step_profile as sp
from bench import train_scale
from bench.tools import hlo_scopes as hs
from bench.tools import kernel_kinds as kk
from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.gpt import build_model

# one stem MLP layer and one MoE layer, 2 micro-batches: every part of the step, compiled in seconds
TINY = ["model.compute_dtype=float32", "model.n_layers=2", "ffn.stem_layers=1", "model.context=32",
        "train.global_batch=8", "train.micro_batch=4"]
MODEL_PARTS = ("embed", "norm", "attention", "residual", "mlp", "moe_proj", "router", "packing", "experts", "combine",
               "lm_head_loss")


def random_state(cfg, seed):
    """A stand-in for `train_scale.host_state` (which builds the model eagerly: one compile per op, ~8 s here): the
    same trees, random values from numpy (the split of a step does not depend on them)."""
    _, params, biases = nnx.split(nnx.eval_shape(lambda: build_model(cfg, seed=seed)), nnx.Param, RouterBias)
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype), (params, biases))


@pytest.fixture(scope="module")
def record():
    """The tiny step's record, its times read from the CPU plane's thunk events (a GPU's come from its kernels')."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_scale, "host_state", random_state)
        return sp.profile_config("configs/tiny_mh_latent_moe.yaml", TINY, devices=1, steps=1, calls=1,
                                 plane="/host:CPU")


def test_the_last_steps_routing_is_recorded(record):
    """The record's times carry the last step's routing per MoE layer (the tiny model's layers past its stems)."""
    routing = record["times"]["routing"]
    assert routing and all(v["groups"] > 0 and v["max_over_mean"] >= 1 for v in routing.values()), routing


def test_every_part_of_the_step_is_found_and_other_is_small(record):
    """Each part of the model and of the step has kernels of its own (none would without the named scopes: all
    would be "other"); what no scope covers (XLA's copies, the loop counter, the schedule) is a small share."""
    hlo = record["hlo"]
    for part in (*MODEL_PARTS, "grad_accum", "optimizer", "balancing"):
        assert hlo[part]["kernels"] > 0 and hlo[part]["runs"] >= hlo[part]["kernels"], (part, hlo[part])
    assert hlo["collectives"]["kernels"] == 0  # one device
    assert record["other_share"]["runs"] < 0.08, record["other_share"]
    # the micro-batch loop runs twice: a matmul inside it runs twice per step, the optimizer's kernels once
    assert record["accum"] == 2 and hlo["mlp"]["runs"] == 2 * hlo["mlp"]["kernels"]
    assert hlo["optimizer"]["runs"] == hlo["optimizer"]["kernels"]


def test_backward_ops_are_marked_bwd(record):
    """The expert FFN's backward (dX and dW of both matmuls: twice the forward's FLOPs) is marked bwd, its forward
    fwd; the step's own parts have no phase."""
    for part in ("experts", "attention", "mlp", "moe_proj"):
        s = record["hlo"][part]
        assert 0 < s["bwd_kernels"] < s["kernels"], (part, s)
        assert s["bwd_dot_flops"] == pytest.approx(2 / 3 * s["dot_flops"]), (part, s)
    assert record["hlo"]["optimizer"]["bwd_kernels"] == 0


def test_floors_flops_equal_the_hlo_dots(record):
    """The floors' FLOPs from the config's shapes against the dots XLA compiled (shapes x trip counts): equal where
    the step computes exactly the needed matmuls; the reference experts compute padding rows too, XLA's attention
    the whole T x T score matrix (the floor counts the causal half)."""
    hlo, fl = record["hlo"], record["floors"]
    for part in ("mlp", "moe_proj", "router", "lm_head_loss"):
        assert hlo[part]["dot_flops"] == pytest.approx(fl[part]["flops"], rel=1e-9), part
    assert hlo["experts"]["dot_flops"] > fl["experts"]["flops"]
    assert fl["attention"]["flops"] < hlo["attention"]["dot_flops"] < 1.2 * fl["attention"]["flops"]


def test_dense_floors_count_the_stems_and_the_layers(monkeypatch):
    """The MLP baseline's floor: its stem layers at stem_hidden and the others at hidden, equal to the dots XLA
    compiled (a floor that took every layer at `hidden` missed the stems' extra width)."""
    monkeypatch.setattr(train_scale, "host_state", random_state)
    rec = sp.profile_config("configs/tiny_mlp.yaml", [*TINY, "ffn.hidden=96"], devices=1)
    assert rec["times"] is None
    assert (rec["attention_impl"], rec["loss_impl"]) == ("xla", "xla")  # the CPU's choices, recorded
    for part in ("mlp", "lm_head_loss"):
        assert rec["hlo"][part]["dot_flops"] == pytest.approx(rec["floors"][part]["flops"], rel=1e-9), part


def test_expert_weight_bytes_move_from_the_accumulation_to_the_experts():
    """With the step context (weights cast once, gradients summed in place by the expert kernels), the expert weights'
    accumulation leaves the grad_accum floor and their bytes join the experts' floor: checked against the expert
    weights counted from the model's own parameter tree."""
    cfg = train_scale.run_config("configs/tiny_mh_latent_moe.yaml", TINY, 1)
    _, params, _ = nnx.split(nnx.eval_shape(lambda: build_model(cfg, seed=0)), nnx.Param, RouterBias)
    keys = lambda path: {getattr(k, "key", None) for k in path}  # noqa: E731
    experts = sum(int(np.prod(leaf.shape)) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                  if {"experts", "w1"} <= keys(path) or {"experts", "w2"} <= keys(path))
    assert experts > 0
    plain, ctx = sp.floors(cfg, 4), sp.floors(cfg, 4, cast=True, in_place=True)
    assert plain["grad_accum"]["bytes"] - ctx["grad_accum"]["bytes"] == 3 * experts * 12
    assert plain["experts"]["bytes"] == experts * 4 * (4 + 4 + 4)  # fp32 weights read twice, gradient written
    # the cast (fp32 read, a copy in the compute dtype, fp32 here, written), then per micro-batch two reads of the
    # copy and the fp32 sum read and written
    assert ctx["experts"]["bytes"] == experts * (4 + 4 + 4 * (2 * 4 + 8))
    assert ctx["experts"]["flops"] == plain["experts"]["flops"]


def test_step_context_is_the_executors_answer(monkeypatch):
    """step_context asks the executor the step would run: the reference ops neither cast nor sum in place; the Triton
    ones (bf16 activations, fp32 weights) cast, and sum in place only with accumulation; the dense model neither."""
    from mhl_jax.parallel import executors
    from mhl_jax.parallel.mesh import make_mesh

    cfg = train_scale.run_config("configs/tiny_mh_latent_moe.yaml", ["model.compute_dtype=bfloat16"], 1)
    mesh = make_mesh(cfg, jax.devices()[:1])
    assert sp.step_context(cfg, mesh, 4) == (False, False)  # CPU: the reference ops
    monkeypatch.setattr(executors, "resolve_kernels", lambda choice: "triton")
    assert sp.step_context(cfg, mesh, 4) == (True, True)
    assert sp.step_context(cfg, mesh, 1) == (True, False)
    cfg.ffn.kind = "mlp"
    assert sp.step_context(cfg, mesh, 4) == (False, False)


def test_times_from_the_trace_map_to_the_compiled_ops(record):
    """The CPU's trace read back by op name: every event of the step's module is one of its compiled ops, the model's
    parts have time, and the record's lines and table carry it."""
    t = record["times"]
    assert t["source"] == "kernel stats" and t["events"] > 0
    assert t["unmapped_ms"] == 0 and t["unmapped"] == [], t["unmapped"]
    for part in ("attention", "experts", "optimizer"):
        assert t["categories"][part]["ms"] > 0, part
    assert t["wall_ms"] > 0 and t["busy_ms"] > 0
    # the idle stretches between the step's kernels, each named by the mapped kernels on either side
    assert t["gaps_top"] and all(g[0].split(":")[0] in hs.CATEGORIES and g[2] > 0 for g in t["gaps_top"])
    # each category's largest ops, and what each is in the program: the attention's largest op sits in its scope
    info = record["kernels_info"]
    assert set(info) == {op for ops in t["kernels_top"].values() for op, *_ in ops}
    top_attention = t["kernels_top"]["attention"][0][0]
    assert "attention" in info[top_attention]["scope"] and info[top_attention]["opcode"]
    assert all(isinstance(v["operands"], list) for v in info.values())
    # every op's time by kind: the full per-op table stays out of the record; a category's kinds hold at most its
    # time (all of it when it has no more than 12 kinds), and the two layers' attention projections are one kind
    assert "per_op" not in t
    for cat, kinds in record["kernels_by_kind"].items():
        total = sum(k["ms"] for k in kinds)
        assert 0 < len(kinds) <= 12 and total <= t["categories"][cat]["ms"] + 1e-6, cat
        assert len(kinds) == 12 or total == pytest.approx(t["categories"][cat]["ms"], abs=1e-5), cat
    assert any(k["ops"] >= 2 for k in record["kernels_by_kind"]["attention"])
    assert record["lines"]["experts"]["x_floor"] > 0
    assert record["lines"]["balancing"]["floor_ms"] is None and record["lines"]["balancing"]["x_floor"] is None
    assert "| experts |" in sp.table(record) and "host gaps" in sp.table(record)


def test_category_times_sums_kernels_by_op():
    """Injected events over a known map: kernel time summed per category and phase, per call; a loop's own event and
    another program's events left out; an unknown op listed as unmapped; busy = the union of the intervals."""
    op = hs.Op
    ops = {"f.1": op("experts", "bwd", "fusion", 1, 0.0, True), "f.2": op("experts", "fwd", "fusion", 1, 0.0, True),
           "a.1": op("optimizer", "", "fusion", 1, 0.0, True), "while.3": op("other", "", "while", 1, 0.0, False)}
    events = [(0, 100, "while.3", "m"), (0, 40, "f.1", "m"), (30, 20, "f.2", "m"), (60, 10, "a.1", "m"),
              (60, 1000, "f.1", "other_module"), (80, 4, "cublas?", "m")]
    t = sp.category_times(events, ops, calls=2, module="m")
    c = t["categories"]
    assert c["experts"] == pytest.approx({"ms": 60 / 2e6, "fwd_ms": 20 / 2e6, "bwd_ms": 40 / 2e6})
    assert c["optimizer"]["ms"] == 10 / 2e6 and c["other"]["ms"] == 0
    assert t["unmapped"] == [("cublas?", round(4 / 2e6, 4))] and t["unmapped_ms"] == 4 / 2e6
    assert t["busy_ms"] == (50 + 10 + 4) / 2e6 and t["events"] == 4
    # per category its ops by time: ms and runs per call
    assert t["kernels_top"] == {"experts": [("f.1", 40 / 2e6, 0.5), ("f.2", 20 / 2e6, 0.5)],
                                "optimizer": [("a.1", 10 / 2e6, 0.5)]}
    assert t["per_op"] == {"experts": {"f.1": (40 / 2e6, 0.5), "f.2": (20 / 2e6, 0.5)},
                           "optimizer": {"a.1": (10 / 2e6, 0.5)}}
    # idle: 50..60 after experts:f.2 (the later end of the overlapping f.1 / f.2), 70..80 after optimizer:a.1
    assert t["gaps_top"] == [("experts:f.2", "optimizer:a.1", 10 / 2e6, 0.5),
                             ("optimizer:a.1", "cublas?", 10 / 2e6, 0.5)]


def test_scope_of_takes_the_innermost_scope():
    assert hs.scope_of("jit(s)/while/body/closed_call/transpose(jvp(moe))/experts/dot_general") == ("experts", "bwd")
    assert hs.scope_of("jit(s)/while/body/jvp(moe)/shard_map/all_to_all") == ("moe", "fwd")
    assert hs.scope_of("jit(s)/optimizer/mul") == ("optimizer", "")
    assert hs.scope_of("jit(s)/while/body/add") == ("other", "")
    assert hs.scope_of("jit(s)/jit(expertsish)/mul") == ("other", "")


def test_collectives_are_classed_by_opcode_on_a_head_parallel_mesh():
    """The Head Parallel executor's forward on a 2-device ('data', 'hp') mesh (the step's backward is checked above):
    its all-to-alls are collectives whatever scope they run under; the rest keeps its scope."""
    from mhl_jax.parallel.head_parallel import HeadParallelMoE

    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "hp"))
    ex = HeadParallelMoE(mesh)
    n, h, dh, ne, de = 8, 2, 8, 4, 8
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (n, h, dh))
    w_r, w1, w2 = (jax.random.normal(k, s) for k, s in zip(ks[1:], [(h, dh, ne), (h, ne, dh, de), (h, ne, de, dh)]))

    def layer(x, w1):
        with jax.named_scope("moe"):
            return ex(x, x, w_r, jnp.zeros((h, ne)), w1, w2, 2)

    ops = hs.hlo_map(jax.jit(layer).lower(x, w1).compile().as_text())
    coll = [o for o in ops.values() if o.category == "collectives"]
    assert all(o.phase == "" for o in coll)
    assert sum(o.opcode == "all-to-all" for o in coll) == 2  # there and back
    assert any(o.category == "experts" and o.kernel for o in ops.values())


def test_cli_refuses_bad_input(capsys):
    with pytest.raises(SystemExit) as e:
        sp.main(["--config", "configs/tiny_mh_latent_moe.yaml", "--devices", "99"])
    assert e.value.code == 2 and "--devices 99" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        sp.main(["--config", "configs/tiny_mh_latent_moe.yaml", "--set", "model.n_layerz=1"])
    assert e.value.code == 2 and "FAILED" in capsys.readouterr().out


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        sp.main(["--help"])
    assert e.value.code == 0 and "usage" in capsys.readouterr().out


HANDWRITTEN = """HloModule jit_f, is_scheduled=true

%fused (p0: f32[4,8], p1: f32[8,16]) -> f32[4,16] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %t = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%t), index=1
  %w = f32[8,16]{1,0} constant({...})
  %mm = f32[4,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused, metadata={op_name="jit(f)/while/body/jvp(experts)/x"}
  %cp = f32[4,16]{1,0} copy(%mm)
  %a2a = f32[4,16]{1,0} all-to-all(%cp), dimensions={0}, metadata={op_name="jit(f)/while/body/jvp(moe)/all_to_all"}
  %s = f32[4,8]{1,0} slice(%a2a), slice={[0:4], [0:8]}, metadata={op_name="jit(f)/while/body/transpose(jvp(combine))/s"}
  ROOT %out = (s32[], f32[4,8]{1,0}) tuple(%i, %s)
}

%cond (t: (s32[], f32[4,8])) -> pred[] {
  %t = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}) tuple(%z, %a)
  %loop = (s32[], f32[4,8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %r = f32[4,8]{1,0} get-tuple-element(%loop), index=1
  ROOT %upd = f32[4,8]{1,0} multiply(%r, %r), metadata={op_name="jit(f)/optimizer/mul"}
}
"""


def test_hlo_map_reads_handwritten_hlo():
    """hlo_map on a module written by hand: a fused dot without an op_name takes its fusion's scope and its FLOPs
    count 3 times (the loop's trip count); a copy without one takes its operand's; an all-to-all is a collective
    under any scope; a loop, tuples and constants launch nothing."""
    ops = hs.hlo_map(HANDWRITTEN)
    assert ops["dot.1"] == hs.Op("experts", "fwd", "dot", 3, 2.0 * 4 * 16 * 8, False)
    assert ops["mm"] == hs.Op("experts", "fwd", "fusion", 3, 0.0, True)
    assert ops["cp"].category == "experts" and ops["cp"].kernel
    assert (ops["a2a"].category, ops["a2a"].phase) == ("collectives", "")
    assert (ops["s"].category, ops["s"].phase) == ("combine", "bwd")
    assert ops["upd"] == hs.Op("optimizer", "", "multiply", 1, 0.0, True)
    assert not ops["loop"].kernel and not ops["w"].kernel and not ops["out"].kernel
    s = hs.summary(ops)
    assert s["experts"]["dot_flops"] == 3 * 2.0 * 4 * 16 * 8 and s["experts"]["kernels"] == 2
    assert s["experts"]["runs"] == 6 and s["collectives"]["runs"] == 3


def _gemm(name: str, out: str, lhs: str, scope: str, target: str = "__cublas$lt$matmul") -> str:
    return (f'  %{name} = f32[{out}]{{1,0}} custom-call(%{lhs}, %b), custom_call_target="{target}", '
            f'metadata={{op_name="jit(k)/{scope}/dot_general"}}')


KINDS_HLO = "\n".join([
    "HloModule jit_k, is_scheduled=true", "",
    "ENTRY %main (a: f32[4,8], b: f32[8,16], c: f32[2,8]) -> f32[4,16] {",
    "  %a = f32[4,8]{1,0} parameter(0)", "  %b = f32[8,16]{1,0} parameter(1)", "  %c = f32[2,8]{1,0} parameter(2)",
    _gemm("custom-call.1", "4,16", "a", "layer_0/jvp(attention)"),  # one GEMM in two layers
    _gemm("custom-call.12", "4,16", "a", "layer_1/jvp(attention)"),
    _gemm("custom-call.3", "2,16", "c", "layer_1/jvp(attention)"),  # another shape
    _gemm("custom-call.4", "4,16", "a", "layer_0/transpose(jvp(attention))"),  # the backward
    _gemm("custom-call.5", "4,16", "a", "layer_0/jvp(attention)", "triton_kernel_call"),  # another target
    "  ROOT %t = (f32[4,16]{1,0}, f32[4,16]{1,0}) tuple(%custom-call.1, %custom-call.12)", "}", ""])


def test_kernels_by_kind_sums_one_computation_over_the_layers():
    """The same GEMM in two layers (custom-call.1, custom-call.12: same target, shapes and phase) is one kind, its
    time and runs summed over both; the same GEMM at another shape, in the backward or with another target is a kind
    of its own. Kinds are ranked by time and cut at n; the printed line names each with its shapes."""
    ops = hs.hlo_map(KINDS_HLO)
    assert (ops["custom-call.4"].category, ops["custom-call.4"].phase) == ("attention", "bwd")
    ms = {"custom-call.1": 3, "custom-call.12": 2, "custom-call.3": 1, "custom-call.4": 3, "custom-call.5": 0.5}
    # two calls, each op once per call: (start ns, duration ns, op, module)
    events = [(int(10e6 * i), int(d * 1e6), op, "") for i, (op, d) in enumerate([*ms.items(), *ms.items()])]
    t = sp.category_times(events, ops, calls=2)
    kinds = kk.kernels_by_kind(KINDS_HLO, t["per_op"], ops)
    gemm = {"kind": "custom-call", "target": "__cublas$lt$matmul", "phase": "fwd", "shape": (4, 16),
            "operands": [(4, 8), (8, 16)]}
    assert kinds == {"attention": [
        {**gemm, "ms": 5.0, "ops": 2, "runs": 2.0, "example": "custom-call.1"},
        {**gemm, "phase": "bwd", "ms": 3.0, "ops": 1, "runs": 1.0, "example": "custom-call.4"},
        {**gemm, "shape": (2, 16), "operands": [(2, 8), (8, 16)], "ms": 1.0, "ops": 1, "runs": 1.0,
         "example": "custom-call.3"},
        {**gemm, "target": "triton_kernel_call", "ms": 0.5, "ops": 1, "runs": 1.0, "example": "custom-call.5"}]}
    assert [k["example"] for k in kk.kernels_by_kind(KINDS_HLO, t["per_op"], ops, n=2)["attention"]] == [
        "custom-call.1", "custom-call.4"]
    assert kk.kinds_line("attention", kinds["attention"], n=2) == (
        "# attention kinds: custom-call:__cublas$lt$matmul[fwd] (4,8) (8,16) -> (4,16) 5.00 ms 2 ops x1; "
        "custom-call:__cublas$lt$matmul[bwd] (4,8) (8,16) -> (4,16) 3.00 ms 1 ops x1")


def test_kind_of_strips_the_numeric_suffixes():
    assert kk.kind_of("triton_kernel_call.164") == "triton_kernel_call"
    assert kk.kind_of("gemm_fusion_dot.45") == "gemm_fusion_dot"
    assert kk.kind_of("fusion.12.clone.3") == "fusion.clone" and kk.kind_of("mm") == "mm"
    shapes = [(8, 2048, 8, 128)] * 6 + [(8, 2048), None, (1,), ()]
    assert kk._shapes(shapes) == "(8,2048,8,128)x6 (8,2048) tuple +2"
