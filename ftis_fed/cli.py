"""The ``ftis-fed`` command line: benchmarks, evaluation, keys, models, and run launchers."""

from __future__ import annotations

import argparse
import sys


def _bench(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side benchmarks (one JSON line each)")
    b = p.add_subparsers(dest="bench", required=True)
    lp = b.add_parser("loss", help="F-TIS vs plain GRPO: loss + backward time ratio")
    lp.add_argument("--model", default="smollm2")
    lp.add_argument("--rows", type=int, default=16)
    lp.add_argument("--completion-len", type=int, default=64)
    lp.add_argument("--repeats", type=int, default=5)
    lp.set_defaults(func=lambda a: __import__("ftis_fed.bench.loss", fromlist=["main"]).main(a))
    from .bench import wire

    wire.add_cli(b)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ftis-fed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _bench(sub)
    from . import launch, signing

    signing.add_cli(sub)
    launch.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
