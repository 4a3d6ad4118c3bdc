"""The course command line: python -m course COMMAND.

Commands: status, check N, hint N, reset N, bench, model-bench, host-bench, sanitize, sass N, notebooks, skeletons, diffs.

Run "python -m course COMMAND --help" for what a command does and its options.
"""

from __future__ import annotations

import argparse
import sys

from course.runtime import stages, validation


def stage_number(text: str) -> int:
    """argparse type: the number of a stage of the registry, else an error that lists them."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a stage number") from None
    try:
        stages.get(number)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error} (`{stages.COURSE_COMMAND} status` lists them)") from None
    return number


def head_groupings(text: str) -> tuple[tuple[int, int], ...]:
    """argparse type: "32/8,64/1" -> ((32, 8), (64, 1)), head groupings as H_q/H_kv."""
    try:
        pairs = tuple(tuple(int(n) for n in item.split("/")) for item in text.split(","))
    except ValueError:
        pairs = ()
    if not pairs or any(len(pair) != 2 or min(pair) < 1 or pair[0] % pair[1] for pair in pairs):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of head groupings H_q/H_kv (H_q a multiple of H_kv) separated by commas, "
            f"e.g. 32/8,64/1; stage 9 times {', '.join(f'{q}/{kv}' for q, kv in stages.GROUPINGS)}")
    return pairs


def head_dim_pairs(text: str) -> tuple[tuple[int, int], ...]:
    """argparse type: "192,192/128,256" -> ((192, 192), (192, 128), (256, 256)), head dims as D or D/D_v."""
    try:
        pairs = tuple((int(d), int(v or d)) for d, _, v in (item.partition("/") for item in text.split(",")))
    except ValueError:
        pairs = ()
    known = validation.HEAD_DIMS_FROM_STAGE_8
    if not pairs or any(pair not in known for pair in pairs):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of head dims D or D/D_v separated by commas, e.g. 192,192/128,256; the prefill "
            f"stages take {', '.join(str(d) if d == v else f'{d}/{v}' for d, v in known)}")
    return pairs


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m course", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", metavar="COMMAND")

    sub.add_parser("status", help="the table of all stages: TODOs left, sm_90a cross-compile, CPU numerics, GPU numerics and speed",
                   description="One row per stage and implementation: TODOs left, whether it cross-compiles for "
                               "sm_90a (with registers and spills), whether its CPU numerics pass, and on a Hopper "
                               "GPU a numerics check and the throughput next to PyTorch's cuDNN attention. A file "
                               "that does not parse or import gets a row that says so. The default command.")

    check = sub.add_parser("check", help="run one stage's tests against your code in stages/ (or the solutions)",
                           description="Run tests/test_stageNN_*.py with pytest against stages/ (yours) or "
                                       "solutions/, and print a verdict: counts, the first failure with the line of "
                                       "your code it points at, and the next step.")
    check.add_argument("stage", type=stage_number, help="the stage number, e.g. 1")
    check.add_argument("--impl", choices=stages.IMPLS, default="stages",
                       help="the code under test: stages (your skeletons, the default) or solutions (the reference)")
    check.add_argument("-k", dest="keyword", metavar="EXPRESSION",
                       help="only the tests whose names match, as pytest -k (e.g. -k cross_compiles, -k 'not gpu')")
    check.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failing test (pytest -x)")
    check.add_argument("-v", "--verbose", action="store_true",
                       help="also show pytest's own report: every test's outcome and full tracebacks")

    hint = sub.add_parser("hint", help="a stage's hints one at a time (the page folds them; raw markdown does not)",
                          description="Without EXERCISE: the stage's exercises, numbered. With it: that exercise's "
                                      "hint LEVEL (1, a nudge, by default; the last is nearly the answer), as the "
                                      "page's folded hints say it, and how to get the next.")
    hint.add_argument("stage", type=stage_number, help="the stage number, e.g. 8")
    hint.add_argument("exercise", nargs="?", help="the exercise's number in the list, or part of its name")
    hint.add_argument("level", nargs="?", type=int, default=1, help="which hint: 1 (the default), 2, 3")

    reset = sub.add_parser("reset", help="start a stage over: restore its skeleton in stages/, keeping a backup",
                           description="Write stage N's skeleton (TODOs and all) to stages/. Your file is kept next "
                                       "to it as stages/stageNN_*.py.bak-<timestamp>.")
    reset.add_argument("stage", type=stage_number, help="the stage number, e.g. 4")

    bench = sub.add_parser("bench", help="time the kernels next to PyTorch SDPA (needs a Hopper GPU)",
                           description="Time each stage's kernel and PyTorch's SDPA backends on the stages' bench "
                                       "shapes, in the same rounds, and write bench.json, bench.md and plots.")
    bench.add_argument("--stage", type=stage_number, action="append",
                       help="a stage number (repeatable; default: every ready stage)")
    bench.add_argument("--impl", choices=stages.IMPLS, default="solutions",
                       help="whose kernels to time: solutions (the default) or stages (yours)")
    bench.add_argument("--out", default=None, help="folder for bench.json/.md/.png (default: docs/results)")
    bench.add_argument("--repeats", type=int, default=50, help="timed repeats per kernel and shape (default: 50)")
    bench.add_argument("--groupings", type=head_groupings, default=None, metavar="H_Q/H_KV,...",
                       help="decode: only the shapes of these head groupings, e.g. 32/8,64/8, to split a long run "
                            "into parts (each merges its rows into OUT/bench.json; runs in other folders: "
                            "`python -m course.tools.results --merge`)")
    bench.add_argument("--head-dims", type=head_dim_pairs, default=None, metavar="D[/D_V],...",
                       help="only the prefill and backward shapes of these head dims, e.g. 192,192/128,256, and no "
                            "ablation, ragged or decode rows (each run merges its rows into OUT/bench.json)")
    bench.add_argument("--replot", action="store_true",
                       help="time nothing: redraw the plots from OUT/bench.json (after a merge; no GPU needed)")

    model_bench = sub.add_parser("model-bench", help="time models end to end on the course backend next to "
                                 "transformers' attention (needs a Hopper GPU and the models extra)")
    model_bench.add_argument("--out", default=None, help="folder for models.json/.md/.png (default: docs/results)")
    model_bench.add_argument("--impl", choices=stages.IMPLS, default="solutions")
    model_bench.add_argument("--repeats", type=int, default=10)
    model_bench.add_argument("--render", action="store_true", help="only rewrite models.md from models.json")

    host_bench = sub.add_parser("host-bench", help="what one call costs the host, next to SDPA cuDNN (needs a "
                                "Hopper GPU)", description="Time the host's part of one eager call of the final "
                                "prefill and decode kernels (and their ops) next to PyTorch SDPA's cuDNN backend, "
                                "and back-to-back eager calls; write host.json and host.md.")
    host_bench.add_argument("--out", default=None, help="folder for host.json/.md (default: docs/results)")
    host_bench.add_argument("--impl", choices=stages.IMPLS, default="solutions")
    host_bench.add_argument("--render", action="store_true", help="only rewrite host.md from host.json")

    sanitize = sub.add_parser("sanitize", help="run the stages' kernels under compute-sanitizer (Hopper GPU)",
                              description="Small launches of each stage's kernels under compute-sanitizer's "
                                          "memcheck, racecheck and synccheck.")
    sanitize.add_argument("stage", type=stage_number, nargs="*", help="stage numbers (default: every ready stage)")
    sanitize.add_argument("--tool", action="append", choices=("memcheck", "racecheck", "synccheck"),
                          help="one tool (repeatable; default: all three)")
    sanitize.add_argument("--jobs", type=int, default=4, help="sanitizer processes at a time (default: 4)")

    sass = sub.add_parser("sass", help="the WGMMA loops of a stage's cross-compiled kernel in SASS (no GPU needed)",
                          description="Cross-compile a stage for sm_90a and print the SASS of its WGMMA loops (the "
                                      "KV loops of a prefill stage, stage 11's loop over Q tiles): the WGMMAs, "
                                      "their waits and the exponentials between them.")
    sass.add_argument("stage", type=stage_number)
    sass.add_argument("--steps", type=int, default=None, help="stage 8: the kernel after this many of its steps")

    skeletons = sub.add_parser("skeletons", help="regenerate stages/ from the solutions' exercise regions",
                               description="Write every stage's skeleton to stages/. Refuses, writing nothing, when "
                                           "a file in stages/ holds your edits (it differs from its skeleton); "
                                           "`reset N` starts one stage over instead.")
    skeletons.add_argument("--force", action="store_true",
                           help="overwrite edited files too, keeping each as stages/stageNN_*.py.bak-<timestamp>")

    notebooks = sub.add_parser("notebooks", help="run every workshop notebook and write executed copies for the site",
                               description="Execute notebooks/*.ipynb top to bottom (on a Hopper GPU: the GPU cells "
                                           "too) and write the executed copies, outputs included, to --out. The docs "
                                           "site shows those instead of the output-free notebooks/ when they exist.")
    notebooks.add_argument("--execute", action="store_true", required=True,
                           help="run every cell (required: notebooks/ itself stays without outputs)")
    notebooks.add_argument("--out", default=None,
                           help="folder for the executed copies (default: docs/notebooks-executed/)")
    notebooks.add_argument("--force", action="store_true",
                           help="without a GPU, write over docs/notebooks-executed/ all the same (its copies "
                                "then show CPU skip messages instead of the GPU cells' outputs)")
    notebooks.add_argument("--only", action="append", metavar="NAME",
                           help="only this notebook (its file name without .ipynb, e.g. 11_backward; repeatable)")
    notebooks.add_argument("--in-process", action="store_true",
                           help="run the cells in this Python process, one namespace, instead of a Jupyter kernel "
                                "(for a machine without one): stdout, stderr and figures become the outputs")

    sub.add_parser("diffs", help="regenerate docs/diffs/ (what each stage changes in the previous solution)",
                   description="Write docs/diffs/stageNN-stageMM.diff for every prefill solution against the one "
                               "it starts from (the stage before it; stage 8: stage 6). The stage pages include them.")
    return top


def run_skeletons(force: bool) -> int:
    from course.tools import skeleton

    try:
        written = skeleton.write_all(force=force)
    except skeleton.EditedSkeletons as edited:
        names = ", ".join(str(p.relative_to(stages.ROOT)) for p in edited.paths)
        print(f"Not overwriting your work: {names} differ from the skeletons the generator made. Nothing was written.\n"
              f"To start one stage over: {stages.COURSE_COMMAND} reset N (keeps a backup of your file).\n"
              f"To regenerate every skeleton anyway: {stages.COURSE_COMMAND} skeletons --force "
              "(keeps a backup of each edited file).")
        return 1
    for path, kept in written:
        mine = f" (your version: {kept.relative_to(stages.ROOT)})" if kept else ""
        print(f"wrote {path.relative_to(stages.ROOT)}{mine}")
    return 0


def run_reset(number: int) -> int:
    from course.tools import skeleton

    stage = stages.get(number)
    kept = skeleton.reset(stage)
    path = stage.path("stages").relative_to(stages.ROOT)
    print(f"{path} is stage {number}'s skeleton again" +
          (f"; your version is in {kept.relative_to(stages.ROOT)}." if kept else " (it already was: no backup needed)."))
    return 0


def main(argv=None) -> int:
    args = parser().parse_args(argv)

    if args.command == "check":
        from course.tools.cli import check as run_check

        return run_check(args.stage, args.impl, keyword=args.keyword, exitfirst=args.exitfirst, verbose=args.verbose)
    if args.command == "reset":
        return run_reset(args.stage)
    if args.command == "hint":
        from course.tools import hints

        return hints.main(args.stage, args.exercise, args.level)
    if args.command == "bench":
        from course.tools import bench as bench_mod

        if args.replot:
            bench_mod.replot(args.out or bench_mod.DEFAULT_OUT)
            return 0
        kwargs = {"impl": args.impl, "repeats": args.repeats, "groupings": args.groupings,
                  "head_dims": args.head_dims}
        if args.out:
            kwargs["out_dir"] = args.out
        bench_mod.run(args.stage, **kwargs)
        return 0
    if args.command == "model-bench":
        from course.tools import model_bench

        out_dir = args.out or model_bench.DEFAULT_OUT
        if args.render:
            model_bench.render(out_dir)
            print(f"wrote {model_bench.MODELS_MD} in {out_dir}")
        else:
            model_bench.run(out_dir=out_dir, impl=args.impl, repeats=args.repeats)
        return 0
    if args.command == "host-bench":
        from course.tools import host_bench

        out_dir = args.out or host_bench.DEFAULT_OUT
        if args.render:
            host_bench.render(out_dir)
            print(f"wrote {host_bench.HOST_MD} in {out_dir}")
        else:
            host_bench.run(out_dir=out_dir, impl=args.impl)
        return 0
    if args.command == "sanitize":
        from course.tools import sanitize as sanitize_mod

        return sanitize_mod.main(args.stage, tuple(args.tool or sanitize_mod.TOOLS), args.jobs)
    if args.command == "sass":
        from course.tools import sass as sass_mod

        return sass_mod.main(args.stage, args.steps)
    if args.command == "skeletons":
        return run_skeletons(args.force)
    if args.command == "notebooks":
        from pathlib import Path

        from course.testing import gpu_skip_reason
        from course.tools import notebooks as notebooks_mod

        out_dir = Path(args.out) if args.out else notebooks_mod.EXECUTED_DIR
        reason = gpu_skip_reason()
        if reason and out_dir.resolve() == notebooks_mod.EXECUTED_DIR.resolve() and not args.force:
            print(f"Not executing into {out_dir}: {reason}. The copies there hold the GPU cells' outputs the "
                  "site shows; run here, they would hold CPU skip messages instead. Write elsewhere with "
                  "--out DIR, or replace them anyway with --force.")
            return 1
        try:
            notebooks_mod.notebooks(args.only)  # before any cell runs: a ValueError from a cell is not a bad name
        except ValueError as error:  # a name --only does not know
            print(error)
            return 2
        written = notebooks_mod.write_executed(out_dir, args.only, args.in_process)
        for path in written:
            print(f"wrote {path}")
        return 0
    if args.command == "diffs":
        from course.tools import diffs

        for path in diffs.write_all():
            print(f"wrote {path}")
        return 0
    from course.tools.cli import status

    return status()


if __name__ == "__main__":
    sys.exit(main())
