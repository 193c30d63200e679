"""Command line: tailrace train | sft | eval | report | bench | sim."""
import sys


def main(argv=None) -> int:
    print("tailrace: not yet wired", file=sys.stderr)
    return 2
