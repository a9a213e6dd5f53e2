"""The `flashmemory-test` command: KV-memory stress and integrity suites."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="flashmemory-test",
        description="KV-memory stress and integrity suites. The MATS suites (`flashmemory-test mats --level N "
        "--duration S`), which will stress the device/host/disk KV levels, are not built yet.",
    )
    parser.parse_args(argv)
    print("flashmemory-test: no suite is available in this release (the MATS suites are not built yet)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
