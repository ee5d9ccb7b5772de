"""Write one benchmark's section of benchmarks/RESULTS.md, replacing its previous one."""

from __future__ import annotations

import platform
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(title: str, command: str, table: str, notes: str = "") -> None:
    """Replace (or append) the section ``## title`` with the table and the command that made it."""
    body = (f"## {title}\n\nCommand: `{command}`  \nMachine: {platform.machine()}, "
            f"Python {platform.python_version()}\n\n{table.rstrip()}\n")
    if notes:
        body += f"\n{notes.rstrip()}\n"
    header = "# Benchmark results\n\nEach section is written by the script it names.\n"
    text = RESULTS.read_text() if RESULTS.exists() else header
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(body + "\n", text)
    else:
        text = text.rstrip() + "\n\n" + body
    RESULTS.write_text(text.rstrip() + "\n")
