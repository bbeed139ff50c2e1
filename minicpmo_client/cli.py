"""The `minicpmo-triton` console script: `minicpmo-triton talk ...` (see `talk --help`)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from . import talk


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minicpmo-triton")
    commands = parser.add_subparsers(dest="command", required=True)
    talk.add_arguments(commands.add_parser("talk", help="talk to the server from the terminal",
                                           description=talk.__doc__,
                                           formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    return asyncio.run(talk.talk(args))


if __name__ == "__main__":
    sys.exit(main())
