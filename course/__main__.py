"""The course command line: ``python -m course status | check N | bench | model-bench | sanitize | skeletons | diffs``."""

from __future__ import annotations

import argparse
import sys

from course import stages


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="course", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("status", help="the table of all stages: TODOs, cross-compile, GPU numerics and speed")
    check = sub.add_parser("check", help="run one stage's tests against your code (stages/) or the solutions")
    check.add_argument("stage", type=int)
    check.add_argument("--impl", choices=stages.IMPLS, default="stages")
    bench = sub.add_parser("bench", help="time the kernels next to PyTorch SDPA (needs a Hopper GPU)")
    bench.add_argument("--stage", type=int, action="append", help="stage number (repeatable; default: all ready)")
    bench.add_argument("--impl", choices=stages.IMPLS, default="solutions")
    bench.add_argument("--out", default=None, help="folder for bench.json/.md/.png (default: docs/results)")
    bench.add_argument("--repeats", type=int, default=50)
    model_bench = sub.add_parser("model-bench", help="time models end to end on the course backend next to "
                                 "transformers' attention (needs a Hopper GPU and the models extra)")
    model_bench.add_argument("--out", default=None, help="folder for models.json/.md/.png (default: docs/results)")
    model_bench.add_argument("--impl", choices=stages.IMPLS, default="solutions")
    model_bench.add_argument("--repeats", type=int, default=10)
    model_bench.add_argument("--render", action="store_true", help="only rewrite models.md from models.json")
    sanitize = sub.add_parser("sanitize", help="run the stages' kernels under compute-sanitizer (Hopper GPU)")
    sanitize.add_argument("stage", type=int, nargs="*", help="stage numbers (default: every ready stage)")
    sanitize.add_argument("--tool", action="append", choices=("memcheck", "racecheck", "synccheck"),
                          help="one tool (repeatable; default: all three)")
    sub.add_parser("skeletons", help="regenerate stages/ from the solutions' exercise regions")
    sub.add_parser("diffs", help="regenerate docs/diffs/ (what each stage changes in the previous solution)")
    args = parser.parse_args(argv)

    if args.command == "check":
        from course.cli import check as run_check

        return run_check(args.stage, args.impl)
    if args.command == "bench":
        from course import bench as bench_mod

        kwargs = {"impl": args.impl, "repeats": args.repeats}
        if args.out:
            kwargs["out_dir"] = args.out
        bench_mod.run(args.stage, **kwargs)
        return 0
    if args.command == "model-bench":
        from course import model_bench

        out_dir = args.out or model_bench.DEFAULT_OUT
        if args.render:
            model_bench.render(out_dir)
            print(f"wrote {model_bench.MODELS_MD} in {out_dir}")
        else:
            model_bench.run(out_dir=out_dir, impl=args.impl, repeats=args.repeats)
        return 0
    if args.command == "sanitize":
        from course import sanitize as sanitize_mod

        return sanitize_mod.main(args.stage, tuple(args.tool or sanitize_mod.TOOLS))
    if args.command == "skeletons":
        from course import skeleton

        for path in skeleton.write_all():
            print(f"wrote {path}")
        return 0
    if args.command == "diffs":
        from course import diffs

        for path in diffs.write_all():
            print(f"wrote {path}")
        return 0
    from course.cli import status

    return status()


if __name__ == "__main__":
    sys.exit(main())
