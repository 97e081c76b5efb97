"""Writes the TorchScript networks of an `interlock export` folder.

    /usr/bin/python3 -m interlock.build DIR [--overwrite]

DIR is what `interlock export --run OUT --to DIR` wrote (export.pbtxt and
weights.pt). Writes DIR/network.pt (the whole network) and DIR/exit_<k>.pt
(blocks 0..k and head k) for every early exit that has no file yet, and lists
them in DIR/export.pbtxt.
"""

import argparse
import sys

from .exported import build_networks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m interlock.build",
        description="TorchScript networks (network.pt, exit_<k>.pt) from an "
                    "`interlock export` folder.")
    parser.add_argument("dir", help="the folder interlock export wrote")
    parser.add_argument("--overwrite", action="store_true",
                        help="rewrite the networks this package wrote before")
    args = parser.parse_args(argv)
    try:
        files = build_networks(args.dir, overwrite=args.overwrite)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"interlock.build: {e}", file=sys.stderr)
        return 1
    for k, path in sorted(files.items()):
        what = "whole network" if k < 0 else f"exit after block {k}"
        print(f"{path}  ({what})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
