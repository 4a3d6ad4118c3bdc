"""Where the warps of stage 8's KV loop wait, from Nsight Compute's per-instruction stall sampling.

    python -m course.tools.stalls --out docs/results    # Hopper GPU with ncu: stage08-stalls.json and .md
    python -m course.tools.stalls --render               # stage08-stalls.json -> stage08-stalls.md, any machine
    python -m course.tools.stalls --impl stages --out /tmp/mine   # your stage 8 instead of the solution

``course sass 8`` shows where ptxas put the softmax between the loop's two ``wait_group``s; this shows
where the time goes when the kernel runs. ``ncu --section SourceCounters`` samples, at a fixed
interval, what each warp is doing and which instruction it waits to issue. The samples of stage 8's
kernel (fp16, D = 128, B = 4, S = 4096, H = 16, one launch after warm-up, non-causal and causal) are
summed over each HGMMA loop, and the loop that holds most of them is cut at its waits: the issue of
the GEMMs (up to the ``wait_group 1``), the ``wait_group 1`` itself (waiting for ``S = Q K^T``), the
softmax between the two waits (under ``P V``), the ``wait_group 0`` (waiting for ``P V``) and the rest
of the softmax after it. A sample on a wait is a warp waiting for the tensor cores; a sample
elsewhere is a warp issuing or waiting on its own instructions.
Never edit the outputs by hand.
"""

from __future__ import annotations

import argparse
import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path

from course.runtime import stages
from course.tools import bench, sass

DEFAULT_OUT = bench.DEFAULT_OUT
JSON, MD = "stage08-stalls.json", "stage08-stalls.md"
ALL = "Warp Stall Sampling (All Samples)"
_SOURCE = re.compile(r"^\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9._]*)\s*([^;]*)")
REGIONS = ("issue", "wait_group 1", "between the waits", "wait_group 0", "after wait_group 0")
MEANING = {"issue": "from the loop's start to its `wait_group 1`: the waits for K and V, the turn, the GEMMs' issue",
           "wait_group 1": "waiting for `S = Q K^T`",
           "between the waits": "softmax while `P V` may still run",
           "wait_group 0": "waiting for `P V`",
           "after wait_group 0": "the rest of the softmax, P and O written"}


def profile_script(causal: bool, impl: str = "solutions") -> str:
    """A program that runs stage 8 (``impl``: "solutions", or "stages" for yours) four times on fresh inputs
    (ncu profiles the fourth launch)."""
    return (f"import sys\nsys.path.insert(0, {str(stages.ROOT)!r})\nimport torch\nfrom course.runtime import stages\n"
            f"attention = stages.get(8).load({impl!r}).attention\n"
            "g = torch.Generator(device='cuda').manual_seed(0)\n"
            "q, k, v = (torch.randn(4, 4096, 16, 128, dtype=torch.float16, device='cuda', generator=g) for _ in range(3))\n"
            f"for _ in range(4):\n    attention(q, k, v, causal={causal})\ntorch.cuda.synchronize()\n")


def source_rows(report: Path) -> list[dict]:
    """The per-instruction rows of an ncu report's source page (SASS)."""
    text = subprocess.run(["ncu", "--import", str(report), "--page", "source", "--csv", "--print-source", "sass"],
                          capture_output=True, text=True, check=True).stdout
    return parse_source_csv(text)


def parse_source_csv(text: str) -> list[dict]:
    """``ncu --page source --csv --print-source sass``: a line naming the kernel, the header, a row per instruction."""
    rows = list(csv.reader(text.splitlines()))
    return [dict(zip(rows[1], row)) for row in rows[2:]]


def instructions(rows: list[dict]) -> list[dict]:
    """(offset, opcode, operands, samples, stall reasons) of every instruction, at offsets from the kernel's
    first instruction (branch targets too), as ``course sass`` reads a cubin."""
    base = int(rows[0]["Address"], 16)
    code = []
    for row in rows:
        match = _SOURCE.match(row["Source"])
        if not match:
            continue
        opcode, operands = match.groups()
        if opcode == "BRA":
            operands = re.sub(r"0x([0-9a-f]{8,})", lambda t: hex(int(t.group(1), 16) - base), operands)
        reasons = {key[len("stall_"):]: int(value) for key, value in row.items()
                   if key.startswith("stall_") and "Not Issued" not in key and value and int(value)}
        code.append({"offset": int(row["Address"], 16) - base, "opcode": opcode, "operands": operands,
                     "samples": int(row[ALL] or 0), "reasons": reasons})
    return code


def loops(code: list[dict]) -> list[dict]:
    """Each HGMMA loop: its first address, whether it masks, its instructions, their samples and MUFU.EX2s."""
    listing = [(c["offset"], c["opcode"], c["operands"]) for c in code]
    found = []
    for start, end, body in sass.hgmma_loops(listing):
        inside = [c for c in code if start <= c["offset"] <= end]
        found.append({"start": start, "masked": body["SEL"] >= 32, "code": inside,
                      "samples": sum(c["samples"] for c in inside), "exp2": body["MUFU.EX2"]})
    return found


def regions(loop: dict) -> dict:
    """{region: {samples, exp2, reasons}} of the loop, cut at its first wait_group 1 and the next wait_group 0."""
    cut, where = {}, "issue"
    for c in loop["code"]:
        if c["opcode"] == "WARPGROUP.DEPBAR.LE" and where in ("issue", "between the waits"):
            where = "wait_group 1" if "0x1" in c["operands"] else "wait_group 0"
        region = cut.setdefault(where, {"samples": 0, "exp2": 0, "reasons": {}})
        region["samples"] += c["samples"]
        region["exp2"] += c["opcode"] == "MUFU.EX2"
        for reason, n in c["reasons"].items():
            region["reasons"][reason] = region["reasons"].get(reason, 0) + n
        if where == "wait_group 1":
            where = "between the waits"
        elif where == "wait_group 0":
            where = "after wait_group 0"
    return cut


def summarize(code: list[dict]) -> dict:
    """The kernel's samples, and per HGMMA loop its share and (for the busiest) its regions."""
    total = sum(c["samples"] for c in code)
    found = loops(code)
    busiest = max(found, key=lambda loop: loop["samples"])
    return {"samples": total,
            "loops": [{"start": loop["start"], "masked": loop["masked"], "instructions": len(loop["code"]),
                       "samples": loop["samples"], "exp2": loop["exp2"],
                       **({"regions": regions(loop)} if loop is busiest else {})} for loop in found]}


def run(out_dir: Path = DEFAULT_OUT, impl: str = "solutions") -> dict:
    import tempfile

    if shutil.which("ncu") is None:
        raise SystemExit("course.tools.stalls needs Nsight Compute's ncu on the PATH and a Hopper GPU")
    results = {"environment": bench.environment(), "impl": impl, "shape": "fp16, D = 128, B = 4, S = 4096, H = 16"}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, causal in (("non-causal", False), ("causal", True)):
            script, report = Path(tmp) / f"{mode}.py", Path(tmp) / f"{mode}.ncu-rep"
            script.write_text(profile_script(causal, impl))
            subprocess.run(["ncu", "--clock-control", "none", "--section", "SourceCounters", "-k", "regex:Attention",
                            "--launch-skip", "3", "--launch-count", "1", "-f", "-o", str(report), sys.executable,
                            str(script)], check=True, capture_output=True)
            results[mode] = summarize(instructions(source_rows(report)))
    bench.save_results(Path(out_dir), JSON, results)
    render(out_dir)
    return results


def table(results: dict) -> str:
    env = results["environment"]
    lines = [f"<!-- generated by python -m course.tools.stalls from docs/results/{JSON}; do not edit -->",
             f"GPU: {env['gpu']}; stage 8 ({results.get('impl', 'solutions')}), {results['shape']}; Nsight Compute's warp stall samples of one launch "
             "(`--section SourceCounters`), summed per region of the KV loop that holds the most of them.", ""]
    for mode in ("non-causal", "causal"):
        summary = results[mode]
        loop = next(loop for loop in summary["loops"] if "regions" in loop)
        share = 100 * loop["samples"] / summary["samples"]
        lines += [f"**{mode}**: the loop at `{loop['start']:#06x}` ({'masked' if loop['masked'] else 'no mask'}, "
                  f"{loop['instructions']} instructions, {loop['exp2']} `MUFU.EX2`) holds {share:.0f}% of the "
                  "kernel's samples.", "",
                  "| region of the loop | what the warps do there | samples (of the loop's) | `MUFU.EX2` | main "
                  "stall reasons |", "|---|---|---:|---:|---|"]
        for name in REGIONS:
            region = loop["regions"].get(name, {"samples": 0, "exp2": 0, "reasons": {}})
            reasons = sorted(region["reasons"].items(), key=lambda item: -item[1])[:3]
            named = ", ".join(f"{reason} {100 * n / max(region['samples'], 1):.0f}%" for reason, n in reasons)
            lines.append(f"| {name} | {MEANING[name]} | {100 * region['samples'] / loop['samples']:.1f}% | "
                         f"{region['exp2']} | {named} |")
        lines.append("")
    return "\n".join(lines)


def render(out_dir: Path = DEFAULT_OUT) -> str:
    return bench.render_results(out_dir, JSON, MD, table)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--render", action="store_true", help=f"{JSON} -> {MD} (no GPU)")
    parser.add_argument("--impl", choices=("solutions", "stages"), default="solutions",
                        help="whose stage 8 to profile: the reference solution, or yours in stages/")
    args = parser.parse_args(argv)
    print(render(args.out) if args.render else table(run(args.out, args.impl)))


if __name__ == "__main__":
    main()
