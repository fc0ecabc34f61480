"""Unpack a ``ttar`` archive, the plain-text file-tree format of Prometheus' node_exporter
and procfs fixtures (``collector/fixtures/sys.ttar``, ``testdata/fixtures.ttar``).

The format is read here rather than by running upstream's ``ttar`` shell script: the
fixtures use three of its records, each block after a ``# ttar - - -`` separator line::

    Directory: <path>              Path: <path>                SymlinkTo: <target>
    Mode: 755                      Lines: <n>                  (after a Path: line)
                                   <n lines of content>
                                   Mode: 644

A content line ending in ``EOF`` (not ``\\EOF``) had no final newline; ``NULLBYTE`` stands
for a NUL byte and ``\\NULLBYTE`` for that word.
"""

from __future__ import annotations

import re
from pathlib import Path

_SEPARATOR = re.compile(r"^# ttar - ")


def _unescape(line: str) -> tuple[str, bool]:
    """One content line -> its text, and whether it ended the file without a newline."""
    no_newline = bool(re.search(r"(?<!\\)EOF$", line))
    if no_newline:
        line = line[:-3]
    line = re.sub(r"(?<!\\)NULLBYTE", "\x00", line).replace("\\NULLBYTE", "NULLBYTE").replace("\\EOF", "EOF")
    return line, no_newline


def unpack(archive: Path, into: Path, *, strip: str = "") -> Path:
    """Write the tree of ``archive`` under ``into``; paths lose the prefix ``strip``.

    Returns ``into``.  Paths that would leave ``into`` are refused (ValueError)."""
    lines = archive.read_text().splitlines()
    root = into.resolve()
    i = 0

    def target(path: str) -> Path:
        if strip and (path + "/").startswith(strip):
            path = path[len(strip):]
        dest = (root / path.lstrip("/")).resolve()
        if dest != root and root not in dest.parents:
            raise ValueError(f"{archive}: {path!r} leaves the target directory")
        return dest

    while i < len(lines):
        line = lines[i]
        i += 1
        if _SEPARATOR.match(line) or line.startswith("#") or not line.strip() or line.startswith("Mode: "):
            continue
        key, _, value = line.partition(": ")
        if key == "Directory":
            target(value).mkdir(parents=True, exist_ok=True)
        elif key == "Path":
            dest = target(value)
            dest.parent.mkdir(parents=True, exist_ok=True)
            count_line = lines[i]
            i += 1
            if count_line.startswith("SymlinkTo: "):
                dest.symlink_to(count_line.removeprefix("SymlinkTo: "))
                continue
            if not count_line.startswith("Lines: "):
                raise ValueError(f"{archive}:{i}: expected 'Lines: N' after {line!r}, got {count_line!r}")
            body = []
            for raw in lines[i:i + int(count_line.removeprefix("Lines: "))]:
                text, no_newline = _unescape(raw)
                body.append(text if no_newline else text + "\n")
            i += int(count_line.removeprefix("Lines: "))
            dest.write_text("".join(body))
        else:
            raise ValueError(f"{archive}:{i}: unknown ttar record {line!r}")
    return into
