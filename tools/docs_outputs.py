"""Regenerates (or checks) the command outputs pasted into docs/, so they cannot go stale.

A generated block in a docs page is a marker line followed by a fenced block:

    <!-- output of: python -m megatron_lite.plan --cluster h100-80g ... -->
    ```
    $ python -m megatron_lite.plan --cluster h100-80g \
        ...
    (the command's standard output)
    ```

``python tools/docs_outputs.py`` reruns every marked command from the repository root and rewrites its
block; ``--check`` only compares and exits 1 naming each stale block (tests/test_docs.py runs it). Only
deterministic commands belong here; measured numbers (benchmarks) say which command measured them instead.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- output of: (?P<command>.+?) -->\n```\n(?P<block>.*?)^```$", re.M | re.S)
WIDTH = 110


def shown_command(command: str) -> str:
    """The command as a reader would type it, wrapped with backslashes at WIDTH."""
    lines = textwrap.wrap("$ " + command, WIDTH - 2, subsequent_indent="    ", break_on_hyphens=False,
                          break_long_words=False)
    return " \\\n".join(lines)


def run(command: str) -> str:
    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"error: `{command}` exited {result.returncode}:\n{result.stderr}")
    return result.stdout


def render(command: str) -> str:
    return f"{shown_command(command)}\n{run(command).rstrip()}\n"


def render_all(commands: list[str]) -> dict[str, str]:
    """Each command's block, the commands run side by side: each is its own process, and the planner's
    searches are seconds of CPU each (tests/test_docs.py waits for all of them)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(commands, pool.map(render, commands)))


def update(page: Path, check: bool, rendered: dict[str, str]) -> list[str]:
    """Rewrites page's generated blocks (or, with check, lists the stale ones) with ``rendered``'s output."""
    text = page.read_text()
    stale = []

    def replace(match: re.Match) -> str:
        fresh = rendered[match["command"]]
        if fresh != match["block"]:
            stale.append(f"{page.relative_to(ROOT)}: `{match['command']}`")
        return f"<!-- output of: {match['command']} -->\n```\n{fresh}```"

    new_text = MARKER.sub(replace, text)
    if not check and new_text != text:
        page.write_text(new_text)
    return stale


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when a block is stale")
    parser.add_argument("pages", nargs="*", type=Path, help="docs pages (default: every docs/*.md)")
    args = parser.parse_args(argv)
    pages = [p.resolve() for p in args.pages] or sorted((ROOT / "docs").glob("*.md"))
    rendered = render_all(sorted({match["command"] for page in pages for match in MARKER.finditer(page.read_text())}))
    stale = [entry for page in pages for entry in update(page, args.check, rendered)]
    for entry in stale:
        print(("stale: " if args.check else "updated: ") + entry)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
