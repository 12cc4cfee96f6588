"""What a step's kernel time is spent on, read from the compiled HLO text (`bench.step_profile`'s records).

- `kernels_info`: each of the categories' largest ops, what it is in the program (opcode, custom-call target, result
  and operand shapes, scope);
- `kernels_by_kind`: all of a category's ops grouped by kind, so that a record tells the GEMMs from the elementwise
  fusions and the Triton kernels even when its largest ops are one kernel repeated in every layer. A kind is an op's
  name without its numeric suffixes (`triton_kernel_call.164` -> `triton_kernel_call`, `gemm_fusion_dot.45` ->
  `gemm_fusion_dot`), its custom-call target (`__cublas$lt$matmul`), its result and operand shapes and its phase
  (fwd / bwd): the same computation in every layer is one kind, the same kernel at another shape or in the other
  pass is not.
"""

from __future__ import annotations

import functools
import re

from bench.tools.hlo_scopes import Instr, Op, parse_hlo

_SUFFIX = re.compile(r"\.\d+(?=\.|$)")  # XLA numbers every copy of a name: fusion.12, fusion.12.clone.3
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


@functools.lru_cache(maxsize=2)  # kernels_info and kernels_by_kind read one module's text in turn
def _instructions(hlo_text: str) -> dict[str, Instr]:
    comps, _ = parse_hlo(hlo_text)
    return {i.name: i for ins in comps.values() for i in ins}


def _target(ins: Instr) -> str | None:
    m = _TARGET.search(ins.text)
    return m.group(1) if m else None


def _operands(ins: Instr, by_name: dict[str, Instr]) -> list:
    return [by_name[o].shape if o in by_name else None for o in ins.operands]


def kernels_info(hlo_text: str, kernels_top: dict[str, list]) -> dict[str, dict]:
    """What each op of `kernels_top` is in the compiled program: its opcode, custom-call target (a cuBLAS GEMM, a
    Triton kernel), result and operand shapes and the end of its scope path, so that a record tells which GEMM or
    kernel a category's time goes to without the HLO text."""
    by_name = _instructions(hlo_text)
    out = {}
    for op in sorted({op for ops in kernels_top.values() for op, *_ in ops}):
        ins = by_name.get(op)
        if ins is None:
            continue
        out[op] = {"opcode": ins.opcode, "target": _target(ins), "shape": ins.shape,
                   "operands": _operands(ins, by_name), "scope": ins.op_name[-200:]}
    return out


def kind_of(name: str) -> str:
    """An op's name without its numeric suffixes: the same name for the same computation in every layer."""
    return _SUFFIX.sub("", name)


def kernels_by_kind(hlo_text: str, per_op: dict[str, dict[str, tuple[float, float]]], ops: dict[str, Op],
                    n: int = 12) -> dict[str, list[dict]]:
    """per_op: per category every op's (ms, runs) per call (`category_times`); ops: the module's `hlo_map` (for the
    phase) -> per category its n kinds with the most time (module docstring), each: `kind` (the name without its
    suffix), `target`, `phase`, `shape`, `operands`, `ms` and `runs` per call summed over its ops, `ops` (how many
    distinct ops) and one `example` op."""
    by_name = _instructions(hlo_text)
    out = {}
    for cat, times in per_op.items():
        kinds = {}
        for op, (ms, runs) in times.items():
            ins = by_name.get(op)
            shapes = (ins.shape, tuple(_operands(ins, by_name))) if ins else (None, ())
            key = (kind_of(op), _target(ins) if ins else None, ops[op].phase if op in ops else "", *shapes)
            k = kinds.setdefault(key, {"ms": 0.0, "ops": 0, "runs": 0.0, "example": op})
            k["ms"] += ms
            k["ops"] += 1
            k["runs"] += runs
        ranked = sorted(kinds.items(), key=lambda kv: -kv[1]["ms"])[:n]
        out[cat] = [{"kind": kind, "target": target, "phase": phase, "shape": shape, "operands": list(operands),
                     "ms": round(k["ms"], 6), "ops": k["ops"], "runs": round(k["runs"], 2), "example": k["example"]}
                    for (kind, target, phase, shape, operands), k in ranked]
    return out


def _shape(s) -> str:
    return "tuple" if s is None else "(" + ",".join(map(str, s)) + ")"


def _shapes(shapes: list, most: int = 3) -> str:
    """Operand shapes, runs of equal ones counted: '(8,2048,8,128)x6 (8,2048)'; past `most` distinct runs, '+N'."""
    runs = []
    for s in shapes:
        if runs and runs[-1][0] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    text = " ".join(_shape(s) + (f"x{c}" if c > 1 else "") for s, c in runs[:most])
    return text + (f" +{len(runs) - most}" if len(runs) > most else "")


def kind_label(k: dict) -> str:
    """A kind in one short phrase: `custom-call:__cublas$lt$matmul[bwd] (2048,1024)x2 -> (2048,4096)`."""
    target = f":{k['target']}" if k["target"] and k["target"] != k["kind"] else ""
    phase = f"[{k['phase']}]" if k["phase"] else ""
    return f"{k['kind']}{target}{phase} {_shapes(k['operands'])} -> {_shape(k['shape'])}"


def kinds_line(category: str, kinds: list[dict], n: int = 3) -> str:
    """A category's n largest kinds, printed as the step profile prints its largest ops: ms and runs per step, the
    distinct ops and each one's runs."""
    return f"# {category} kinds: " + "; ".join(
        f"{kind_label(k)} {k['ms']:.2f} ms {k['ops']} ops x{k['runs'] / k['ops']:.3g}" for k in kinds[:n])
