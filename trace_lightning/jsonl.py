"""JSONL files: read line by line, with the line that fails named; written whole or not at
all."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path


def write_records(records: Iterable[dict], path: str | Path) -> None:
    """Write ``records`` one JSON object per line, to a temp file renamed over ``path`` once
    complete (a reader never sees half a file; a failed write leaves no temp file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def jsonl_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each non-blank line of ``path``, decoded as UTF-8, without
    its line ending (so a JSON error's column is on the record's own line 1).

    Decoded line by line (not by the file object's buffer), so a line that is not UTF-8 (a
    Latin-1 export) is a ValueError naming the file and the line, not a ``UnicodeDecodeError``
    at a byte offset into some buffer. A UTF-8 byte-order mark is skipped; a gzip file is a
    ValueError that says to decompress it, a UTF-16 one (byte-order mark FF FE or FE FF) one
    that says to convert it from UTF-16 (not Latin-1, which would garble it).
    """
    with Path(path).open("rb") as f:
        head = f.read(2)
        if head == b"\x1f\x8b":
            raise ValueError(f"{path} is gzip-compressed, not JSONL text; decompress it first "
                             f"(`gunzip -k {path}`) and pass the .jsonl")
        if head in (b"\xff\xfe", b"\xfe\xff"):
            raise ValueError(f"{path} is UTF-16 (it starts with a UTF-16 byte-order mark), not "
                             f"UTF-8; convert it (`iconv -f utf-16 -t utf-8 {path} > "
                             f"{Path(path).stem}.utf8.jsonl`) and pass the converted file")
        f.seek(0)
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{line_no} is not UTF-8 ({e}); convert the file, e.g. "
                                 f"`iconv -f latin1 -t utf-8`") from None
            if line_no == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark (Windows editors)
            if line.strip():
                yield line_no, line.rstrip("\r\n")
