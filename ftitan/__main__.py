"""``ftitan`` / ``python -m ftitan``: the command line.

Commands so far: ``ftitan bench step [--out FILE] [...]``.
"""

from __future__ import annotations

import sys

USAGE = """usage: ftitan bench step [options]   (see: ftitan bench step --help)"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "step"]:
        from ftitan.bench.step import main as bench_step

        return bench_step(argv[2:])
    print(USAGE, file=sys.stderr)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main())
