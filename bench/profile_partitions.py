"""Split a warp-specialised kernel's per-instruction warp-state samples (the raw CSV of `bench/profile_sass.py --csv`)
into its partitions and summarise each: samples, stall reasons, opcode classes, top instructions.

    python bench/profile_partitions.py FILE.csv [--top 8] [--out FILE]

Partitions are cut at the SASS's register reconfigurations (USETMAXREG): each warp group's code starts at one (the
consumers raise their count, the producer and other workers lower it), so the regions between them are the
partitions' code, in address order (named by their register count). One JSON line per partition
(`bench: profile_partitions`): samples, share of the kernel's, stall reasons (share of the partition's samples),
opcode classes (share) and the top instructions.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from collections import Counter

CLASSES = [("wgmma wait", r"^WARPGROUP\.DEPBAR"), ("wgmma issue", r"^(HGMMA|WARPGROUP\.ARRIVE)"),
           ("mbarrier wait", r"^(SYNCS\.PHASECHK|@!?U?P\d+ +BRA|BRA)"), ("barrier / fence", r"^(BAR|MEMBAR|FENCE)"),
           ("fp32 math", r"^(FADD|FMUL|FFMA|FMNMX|FSEL|FSETP|MUFU)"), ("conversion", r"^(F2F|F2FP|I2F|F2I)"),
           ("shuffle", r"^SHFL"), ("shared memory", r"^(LDS|STS|LDSM|STSM)"), ("global memory", r"^(LDG|STG|LDGSTS)"),
           ("local (spill)", r"^(LDL|STL)")]


def opclass(sass: str) -> str:
    """The class of one SASS instruction; a predicated branch is the retry loop of an mbarrier wait."""
    s = sass.strip()
    if not re.match(r"@!?U?P\w+\s+BRA", s):
        s = re.sub(r"^@!?U?P\w+\s+", "", s)  # the opcode, without its predicate
    for name, pat in CLASSES:
        if re.match(pat, s):
            return name
    return "other"


SETMAXNREG = re.compile(r"USETMAXREG\.(\w+)\.CTAPOOL(?: UP0,)? (0x[0-9a-f]+)")


def partition_name(sass: str) -> str | None:
    """The partition a register reconfiguration (USETMAXREG) starts, named by its kind and count ("try_alloc 208",
    "dealloc 32"); None for any other instruction. The code before the first one is "setup"."""
    m = SETMAXNREG.search(sass)
    return f"{m.group(1).lower()} {int(m.group(2), 16)}" if m else None


def partitions(path: str) -> list[dict]:
    with open(path) as f:
        rows = [r for r in csv.reader(f) if r]
    start = next(i for i, r in enumerate(rows) if r[:2] == ["Address", "Source"])
    hdr, body = rows[start], rows[start + 1:]
    col = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    parts, cur = [], {"name": "setup", "rows": []}
    for r in body:
        sass = r[col["Source"]].strip()
        name = partition_name(sass)
        if name:
            parts.append(cur)
            cur = {"name": name, "rows": []}
        cur["rows"].append(r)
    parts.append(cur)
    total = sum(float(r[col["# Samples"]] or 0) for r in body)
    out = []
    for p in parts:
        n = sum(float(r[col["# Samples"]] or 0) for r in p["rows"])
        if n == 0:
            continue
        st = Counter({s: sum(float(r[col[s]] or 0) for r in p["rows"]) for s in stalls})
        cl = Counter()
        for r in p["rows"]:
            cl[opclass(r[col["Source"]])] += float(r[col["# Samples"]] or 0)
        top = sorted(p["rows"], key=lambda r: -float(r[col["# Samples"]] or 0))
        out.append(dict(partition=p["name"], instructions=len(p["rows"]), samples=n, share=round(n / total, 4),
                        stalls={k[6:]: round(v / n, 3) for k, v in st.most_common() if v / n >= 0.01},
                        classes={k: round(v / n, 3) for k, v in cl.most_common() if v},
                        top=[(r[col["Source"]].strip(), round(float(r[col["# Samples"]] or 0) / n, 3))
                             for r in top[:8]]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    outf = open(args.out, "a") if args.out else None
    for rec in partitions(args.csv):
        rec["top"] = rec["top"][:args.top]
        line = json.dumps(dict(bench="profile_partitions", source=args.csv.rsplit("/", 1)[-1], **rec))
        print(line, file=outf or sys.stdout)
        if outf:
            print(f"{rec['partition']:>14} {rec['share']:6.1%} of samples, {rec['instructions']} instructions")
            print("   stalls ", rec["stalls"])
            print("   classes", rec["classes"])
            for s, sh in rec["top"]:
                print(f"   {sh:6.1%} {s}")


if __name__ == "__main__":
    main()
