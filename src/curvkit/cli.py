"""Command line: ``curvkit reproduce NAME [--scale smoke|medium|paper] [--out DIR] [--seed S]``,
``curvkit reproduce --list``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from curvkit.experiments import registry


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="curvkit", description="Curvature of neural networks.")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("reproduce", help="run a registered experiment and write its report")
    rep.add_argument("name", nargs="?", help="experiment name (see --list)")
    rep.add_argument("--list", action="store_true", help="list the registered experiments")
    rep.add_argument("--scale", default="smoke", choices=registry.SCALES)
    rep.add_argument("--out", default=None, help="output directory (default results/NAME-SCALE)")
    rep.add_argument("--seed", type=int, default=0)
    rep.add_argument("--distributed", action="store_true",
                     help="data-parallel under torchrun (automatic when WORLD_SIZE > 1): the optimisers that take "
                          "step(batch=...) split each minibatch over the processes; rank 0 writes --out")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "reproduce":
        exps = registry.load_all()
        if args.list or not args.name:
            for exp in exps.values():
                print(f"{exp.name:28s} scales: {'/'.join(exp.scales):20s} {exp.description}")
            return 0
        if args.name not in exps:
            print(f"unknown experiment {args.name!r}; available: {', '.join(exps)}", file=sys.stderr)
            return 2
        out = Path(args.out) if args.out is not None else Path("results") / f"{args.name}-{args.scale}"
        from curvkit.distributed import env_world_size

        if args.distributed or env_world_size() > 1:  # torchrun --nproc_per_node=N -m curvkit reproduce ...
            _reproduce_distributed(args, out)
        return _reproduce(args, out)
    return 2


def _reproduce(args: argparse.Namespace, out: Path, announce: bool = True) -> int:
    try:
        if args.out is not None and not args.out.strip():
            raise registry.ExperimentError("--out is empty; pass a directory path (e.g. --out results/run1), "
                                           "or leave --out out for results/NAME-SCALE")
        # the scale and the output directory are checked before the experiment starts
        registry.run(args.name, args.scale, out, seed=args.seed)
    except registry.ExperimentError as err:
        print(f"curvkit reproduce: error: {err}", file=sys.stderr)
        return 2
    if announce:
        print(f"report written to {out}")
    return 0


def _reproduce_distributed(args: argparse.Namespace, out: Path) -> NoReturn:
    """One rank of ``curvkit reproduce`` under torchrun: rank 0 writes the report into ``out``, the others
    keep only their checkpoints in ``out/.rank{r}``; every rank then ends through
    :func:`curvkit.distributed.finish` (exit code 0 after correct work, 1 after an error, never a crash in
    the interpreter's teardown)."""
    import traceback

    from curvkit.distributed.launch import discard_report, finish, init_experiment, writes_report

    code = 1
    try:
        out = init_experiment(out)
        code = _reproduce(args, out, announce=writes_report())
        discard_report(out)
    except BaseException:
        traceback.print_exc()
        code = 1
    finish(code)


if __name__ == "__main__":
    raise SystemExit(main())
