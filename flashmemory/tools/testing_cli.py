"""The `flashmemory-test` command: KV-memory stress and integrity suites (`flashmemory-test mats --level N
--duration S`; see flashmemory/tools/mats/ and docs/mats.md)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from flashmemory.tools.mats.command import add_mats_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashmemory-test",
                                     description="KV-memory stress and integrity suites. "
                                                 "`flashmemory-test mats --help` says what each level checks.")
    subparsers = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    add_mats_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
