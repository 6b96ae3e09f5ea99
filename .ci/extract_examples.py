"""Write the complete example files of the extension guide into the tree, for CI to run the suite with them.

A file is a fenced code block preceded by `<!-- example-file: PATH -->` (PATH relative to the repository root).
Every PATH must be new: an example that overwrote a real file would test the real file's replacement, not an
addition. Prints the paths written, one a line, so CI can remove them and check nothing else changed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

MARKER = re.compile(r"^<!-- example-file: (\S+) -->$")


def examples(doc: str) -> dict[str, str]:
    """PATH -> file text for every marked block of `doc`."""
    lines = doc.splitlines()
    found: dict[str, str] = {}
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise SystemExit(f"example-file {m.group(1)}: the marker must stand right above a fenced code block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise SystemExit(f"example-file {m.group(1)}: its code block is not closed")
        if m.group(1) in found:
            raise SystemExit(f"example-file {m.group(1)}: marked twice")
        found[m.group(1)] = "\n".join(lines[i + 2 : end]) + "\n"
    return found


def main(doc_path: str, root: str = ".") -> None:
    files = examples(Path(doc_path).read_text(encoding="utf-8"))
    if not files:
        raise SystemExit(f"{doc_path}: no example-file markers")
    for rel in files:
        if (Path(root) / rel).exists():
            raise SystemExit(f"example-file {rel} already exists; examples must be new files")
    for rel, text in files.items():
        path = Path(root) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(rel)


if __name__ == "__main__":
    main(*sys.argv[1:])
