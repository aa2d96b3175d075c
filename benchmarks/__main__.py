"""``python -m benchmarks list | run NAME [options] | rows``: what there is, one run, and the
README rows of the results files (for docs/results.md)."""

from __future__ import annotations

import sys

from benchmarks.harness import claim, names, readme_rows, run

USAGE = ("usage: python -m benchmarks list | run NAME [--quick] [options] | rows\n"
         "  list   every benchmark and its claim\n"
         "  run    one benchmark (`run NAME --help`: its options)\n"
         "  rows   the docs/results.md rows of the results files")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] == "list":
        for name in names():
            print(f"{name:24} {claim(name)}")
        return 0
    if argv[0] == "run" and len(argv) >= 2:
        run(argv[1], argv[2:])
        return 0
    if argv[0] == "rows":
        print("\n".join(readme_rows()))
        return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
