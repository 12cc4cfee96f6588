"""A compiled program's HLO instructions by the part of the model or of the train step they belong to.

The model and the train step run each part under a `jax.named_scope` (SCOPES); JAX writes the scope path into every
HLO instruction's `metadata={op_name="..."}` and XLA keeps it through compilation, e.g.

    jit(train_step)/while/body/closed_call/transpose(jvp(moe))/experts/dot_general

`hlo_map(compiled.as_text())` reads the compiled module's text and gives every instruction:

- its category: the innermost scope of SCOPES on its op_name path (so `experts` inside `moe`), "collectives" for a
  communication op (by opcode, whatever its scope: all-to-all, all-reduce, all-gather, reduce-scatter,
  collective-permute, send / recv, and fusions or async ops wrapping one), else "other". A fusion is one kernel
  whose parts may come from several scopes: it takes its own op_name, which XLA copies from the fused computation's
  root (the last op it computes), so a norm fused into the matmul after it counts as that matmul's. An instruction
  XLA made without an op_name (a copy it inserted, a dot a pass rewrote) takes the category of its first operand
  that has one, and inside a fusion that of the fusion;
- its phase: "bwd" when the path holds a `transpose(...)` (autodiff's backward; a rematerialised forward recomputed
  there counts as backward, and a custom_vjp's backward runs under `transpose(jvp(scope))/...`), else "fwd";
- how often it runs per call: the product of the known trip counts of the while loops around it (the micro-batch
  scan, the chunked loss's scan);
- for a dot, its FLOPs: 2 x output elements x contracted size (custom calls, such as cuBLAS GEMMs and Triton
  kernels on a GPU, have none here).

`summary` adds these up per category: the kernels (instructions that run as a kernel or a thunk: not parameters,
tuples, bitcasts, loops), their executions per call and the dot FLOPs per call.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

# The scope names the code runs its parts under, and where:
#   embed, norm, attention, residual, mlp, lm_head_loss   mhl_jax/model (gpt, norms, attention, mlp)
#   moe_proj (LatentMoE / MH-LatentMoE projections), moe (the executor: layouts, exchanges)   mhl_jax/model/moe.py
#   router, packing, experts, combine        mhl_jax/moe (core, experts, gpu), mhl_jax/parallel/expert_parallel.py
#   grad_accum, optimizer, balancing, experts (the step's expert-weight casts)   mhl_jax/train/step.py
SCOPES = ("embed", "norm", "attention", "residual", "mlp", "moe_proj", "moe", "router", "packing", "experts",
          "combine", "lm_head_loss", "grad_accum", "optimizer", "balancing")
# the categories of the step rather than of the model: one phase, no fwd / bwd split
STEP_SCOPES = ("grad_accum", "optimizer", "balancing")
CATEGORIES = (*SCOPES, "collectives", "other")

COLLECTIVE_OPS = ("all-to-all", "ragged-all-to-all", "all-reduce", "all-gather", "reduce-scatter",
                  "collective-permute", "collective-broadcast", "send", "recv")
# instructions that launch nothing themselves (their computations' instructions do, or nothing does)
NO_KERNEL_OPS = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
                 "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain")

_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLED = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|called_computations)="
                     r"(\{[^}]*\}|%[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_WRAPPED = re.compile(r"^[\w.\-]+\((.*)\)$")


class Instr(NamedTuple):
    name: str
    computation: str
    opcode: str
    shape: tuple[int, ...] | None  # dims of an array result; None for a tuple or a token
    operands: tuple[str, ...]
    op_name: str
    called: tuple[tuple[str, str], ...]  # (attribute, computation): calls=, body=, condition=, to_apply=, ...
    text: str  # the attributes after the operands


class Op(NamedTuple):
    category: str
    phase: str  # "fwd", "bwd", or "" for the step's own parts and the unscoped
    opcode: str
    runs: int  # executions per call of the program
    flops: float  # per execution: a dot's, 0 for anything else
    kernel: bool  # launches work of its own (a kernel or a thunk)


def _closing(s: str, depth: int = 0) -> int:
    """The index in s of the parenthesis that brings `depth` open ones (before s) back to 0; len(s) if none does."""
    for i, ch in enumerate(s):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return i
    return len(s)


def _split_type(rest: str) -> tuple[str, str]:
    """'f32[4,8]{1,0} dot(%a, %b), ...' -> ('f32[4,8]{1,0}', 'dot(%a, %b), ...'); a tuple type in parentheses whole."""
    if rest.startswith("("):
        end = _closing(rest) + 1
        return rest[:end], rest[end:].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail


def _dims(typ: str) -> tuple[int, ...] | None:
    m = re.match(r"^[a-z0-9]+\[([\d,]*)\]", typ)
    if m is None:
        return None
    return tuple(int(d) for d in m.group(1).split(",") if d)


@functools.lru_cache(maxsize=1)  # a profile reads one module's text twice (`hlo_map`, then its top ops' details)
def parse_hlo(text: str) -> tuple[dict[str, list[Instr]], str]:
    """Compiled HLO module text -> ({computation: its instructions}, the entry computation's name); callers only
    read the result (it is cached)."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h and "=" not in line.split("(")[0]:
            current = h.group(2)
            comps[current] = []
            if h.group(1):
                entry = current
            continue
        m = _INSTR.match(line)
        if m is None or current is None:
            continue
        typ, rest = _split_type(m.group(2))
        op = re.match(r"^([\w\-]+)\((.*)", rest)
        if op is None:
            continue
        opcode, args = op.group(1), op.group(2)
        end = _closing(args, 1)  # the operand list's end
        attrs = args[end + 1:]
        called = tuple((kind, c) for kind, v in _CALLED.findall(attrs) for c in re.findall(r"%([\w.\-]+)", v))
        name_m = _OP_NAME.search(attrs)
        comps[current].append(Instr(m.group(1), current, opcode, _dims(typ),
                                    tuple(re.findall(r"%([\w.\-]+)", args[:end])),
                                    name_m.group(1) if name_m else "", called, attrs))
    if entry is None:
        raise ValueError("hlo_map: no ENTRY computation in the text: expected a compiled HLO module's as_text()")
    return comps, entry


def scope_of(op_name: str) -> tuple[str, str]:
    """(category, phase) of an op_name path: its innermost scope of SCOPES ("other" without one), "bwd" under a
    transpose. A step scope has no phase; neither has "other"."""
    found = None
    for part in op_name.split("/"):
        inner = part
        while (w := _WRAPPED.match(inner)) is not None:  # transpose(jvp(attention)) -> attention
            inner = w.group(1)
        if inner in SCOPES:
            found = inner
    if found is None:
        return "other", ""
    if found in STEP_SCOPES:
        return found, ""
    return found, "bwd" if "transpose(" in op_name else "fwd"


def _is_collective(ins: Instr, comps: dict[str, list[Instr]]) -> bool:
    if any(ins.opcode == c or ins.opcode.startswith(c + "-") for c in COLLECTIVE_OPS):
        return True
    if ins.opcode in ("fusion", "async-start", "async-update", "async-done", "call", "custom-call"):
        return any(_is_collective(i, comps) for _, c in ins.called for i in comps.get(c, ())
                   if i.opcode not in NO_KERNEL_OPS)
    return False


def _dot_flops(ins: Instr, shapes: dict[str, tuple[int, ...] | None]) -> float:
    if ins.opcode != "dot" or ins.shape is None or not ins.operands:
        return 0.0
    lhs = shapes.get(ins.operands[0])
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.text)
    if lhs is None or m is None:
        return 0.0
    contracted = 1
    for d in (int(x) for x in m.group(1).split(",") if x):
        contracted *= lhs[d]
    out = 1
    for d in ins.shape:
        out *= d
    return 2.0 * out * contracted


def _runs(comps: dict[str, list[Instr]], entry: str) -> tuple[dict[str, int], set[str]]:
    """(executions per call of each computation reached from the entry, the computations whose instructions run
    as kernels of their own: the entry, loop bodies and conditions, branches, async and called computations; not
    fused computations or reducers)."""
    runs, top = {entry: 1}, {entry}
    order = [entry]
    for comp in order:  # breadth first: a computation's callers come before it
        for ins in comps.get(comp, ()):
            trip = _TRIP.search(ins.text)
            for kind, child in ins.called:
                n = runs[comp] * (int(trip.group(1)) if trip and kind in ("body", "condition") else 1)
                if child not in runs:
                    order.append(child)
                runs[child] = runs.get(child, 0) + n
                if comp in top and (kind in ("body", "condition", "branch_computations")
                                    or ins.opcode in ("call", "async-start")):
                    top.add(child)
    return runs, top


def hlo_map(text: str) -> dict[str, Op]:
    """Every instruction of the compiled module `text` by name (names are unique in a module) -> its Op."""
    comps, entry = parse_hlo(text)
    shapes = {i.name: i.shape for ins in comps.values() for i in ins}
    runs, top = _runs(comps, entry)
    scope = {i.name: scope_of(i.op_name) for ins in comps.values() for i in ins}
    for comp in top:  # in text order: an operand's category is settled before its users'
        for ins in comps[comp]:
            if not ins.op_name:
                scope[ins.name] = next((scope[o] for o in ins.operands if scope.get(o, ("other",))[0] != "other"),
                                       scope[ins.name])
    for ins in (i for c in top for i in comps[c] if i.opcode == "fusion"):
        for _, called in ins.called:
            for inner in comps.get(called, ()):
                if not inner.op_name:
                    scope[inner.name] = scope[ins.name]
    out = {}
    for comp, instrs in comps.items():
        for ins in instrs:
            category, phase = ("collectives", "") if _is_collective(ins, comps) else scope[ins.name]
            out[ins.name] = Op(category, phase, ins.opcode, runs.get(comp, 0), _dot_flops(ins, shapes),
                               comp in top and ins.opcode not in NO_KERNEL_OPS)
    return out


def summary(ops: dict[str, Op]) -> dict[str, dict]:
    """Per category: `kernels` (instructions that launch work), `runs` (their executions per call), `dot_flops` per
    call (every dot, fused or not), each also split by phase (`bwd_kernels`, `bwd_dot_flops`)."""
    out = {c: {"kernels": 0, "runs": 0, "dot_flops": 0.0, "bwd_kernels": 0, "bwd_dot_flops": 0.0}
           for c in CATEGORIES}
    for op in ops.values():
        s = out[op.category]
        s["dot_flops"] += op.flops * op.runs
        if op.phase == "bwd":
            s["bwd_dot_flops"] += op.flops * op.runs
        if op.kernel:
            s["kernels"] += 1
            s["runs"] += op.runs
            s["bwd_kernels"] += op.phase == "bwd"
    return out
