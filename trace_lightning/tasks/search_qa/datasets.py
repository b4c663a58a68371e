"""Question-answer data: one loader for our JSONL schema and FlashRAG/Search-R1's, and a
stable train/validation split.

Our schema: ``{"id", "question", "answers": [gold, *aliases], "dataset",
"supporting_titles", ...}``. FlashRAG's: ``{"id", "question", "golden_answers": [...],
"metadata": {...}}``; its HotpotQA files keep supporting facts as
``metadata.supporting_facts.title``. Unknown fields are ignored.

The split puts an example in validation when a hash of ``(seed, id)`` falls below
``val_fraction``, so each example's side depends on its own id only: adding or removing
other examples never moves it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shlex
from pathlib import Path

from trace_lightning.jsonl import jsonl_lines
from trace_lightning.tasks.search_qa.reward import normalize_answer
from trace_lightning.tasks.base import Example

log = logging.getLogger(__name__)

_SCHEMA = ('each line must be a JSON object {"id", "question", "answers": [str, ...]} '
           '(or FlashRAG\'s "golden_answers" instead of "answers")')


def _supporting_titles(record: dict) -> list[str]:
    titles = record.get("supporting_titles")
    if titles is None:
        facts = (record.get("metadata") or {}).get("supporting_facts")
        titles = facts.get("title") if isinstance(facts, dict) else None
    if not isinstance(titles, list):
        return []
    return list(dict.fromkeys(t for t in titles if isinstance(t, str)))


def _parse(record: object, where: str, dataset: str) -> Example:
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a JSON {type(record).__name__}, not an object; {_SCHEMA}")
    qid = record.get("id")
    if isinstance(qid, int) and not isinstance(qid, bool):
        qid = str(qid)
    if not isinstance(qid, str) or not qid:
        raise ValueError(f"{where} has no string \"id\" (got {qid!r}); {_SCHEMA}")
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where} (id {qid!r}) has an empty or missing \"question\" "
                         f"({question!r}); {_SCHEMA}")
    if "answers" not in record and "golden_answers" not in record:
        hint = (' (it has "answer": use a list, "answers": ["..."])' if "answer" in record
                else "")
        raise ValueError(f"{where} (id {qid!r}) has neither \"answers\" nor "
                         f"\"golden_answers\"{hint}; {_SCHEMA}")
    key = "answers" if "answers" in record else "golden_answers"
    raw = record.get(key)
    if not isinstance(raw, list) or not all(
            isinstance(a, (str, int, float)) and not isinstance(a, bool)
            and not (isinstance(a, float) and not math.isfinite(a)) for a in raw):
        raise ValueError(f"{where} (id {qid!r}): \"{key}\" must be a list of strings, got "
                         f"{json.dumps(raw)[:100]}; {_SCHEMA}")
    if floats := [a for a in raw if isinstance(a, float)]:
        # JSON's 2.50 and 1e3 read as 2.5 and 1000.0: the gold answer would change
        raise ValueError(f"{where} (id {qid!r}): \"{key}\" must be a list of strings, and it "
                         f"holds the number {floats[0]!r}, which would be matched as "
                         f"{str(floats[0])!r}, not as the file writes it (JSON reads 2.50 as "
                         f"2.5, 1e3 as 1000.0); write it as a string, as it should be matched "
                         f"(\"2.50\", not 2.50)")
    answers = [str(a) for a in raw if str(a).strip()]
    if not answers:
        raise ValueError(f"{where} (id {qid!r}) has no non-empty answer in \"{key}\" "
                         f"({raw!r}); every question needs at least one gold answer")
    name = record.get("dataset")
    return Example(id=qid, question=question, answers=answers,
                     dataset=name if isinstance(name, str) and name else dataset,
                     extras={"supporting_titles": _supporting_titles(record)})


def _json_array_message(path: Path, line_no: int) -> str:
    """Why a file that is one JSON array (HotpotQA's official ``[{...}, ...]``) is refused."""
    out = path.with_suffix(".jsonl")
    if out == path:  # never suggest redirecting onto the file being read
        out = path.with_name(f"{path.stem}.lines.jsonl")
    return (f"{path} is one JSON array (line {line_no} starts with '['), not JSON Lines (one "
            f"object per line); convert it, e.g. `python -c \"import json,sys; "
            f"[print(json.dumps(r)) for r in json.load(open(sys.argv[1]))]\" "
            f"{shlex.quote(str(path))} > {shlex.quote(str(out))}`, and pass {out}; {_SCHEMA}")


def load_qa(path: str | os.PathLike, dataset: str | None = None,
            limit: int | None = None) -> list[Example]:
    """Read a QA JSONL (our schema or FlashRAG's), in file order; blank lines are skipped.

    A file with no record at all is a ValueError that says it is empty, and one that is a
    single JSON array (HotpotQA's official ``[{...}, ...]``, on one line or pretty-printed) one
    that says how to convert it to JSON Lines.

    Integer answers become strings (``8`` -> ``"8"``); any other number is a ValueError
    (JSON's ``2.50`` reads as ``2.5``: the gold answer would change). Questions none of whose
    answers survives the reward's normalisation (``normalize_answer``: e.g. ``"---"``,
    ``")"``, ``"The"``) can never score; they are kept, as the real NQ test file has two, and
    one warning per file counts them and names the first few ids.

    Args:
        path: the JSONL file.
        dataset: name for records without a "dataset" field; None = the file's folder name.
        limit: keep the first ``limit`` examples only; None = all.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"QA file {path} is a directory, not a file; pass the JSONL "
                                f"inside it, e.g. {path / 'dev_distractor.jsonl'}")
    if not path.is_file():
        raise FileNotFoundError(f"QA file {path} does not exist; pass a JSONL of QA records, "
                                f"{_SCHEMA}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit ({limit}) must be >= 0 or None (all examples)")
    fallback = dataset or path.resolve().parent.name
    examples: list[Example] = []
    first_line: dict[str, int] = {}
    unscorable: list[str] = []  # ids of questions no answer can score on
    if limit == 0:
        return examples
    for line_no, line in jsonl_lines(path):
        where = f"{path}:{line_no}"
        first = not examples  # the file's first record
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if first and line.lstrip().startswith("["):
                raise ValueError(_json_array_message(path, line_no)) from None
            raise ValueError(f"{where} is not JSON ({e}); {_SCHEMA}") from None
        if first and isinstance(record, list) and all(isinstance(r, dict) for r in record):
            raise ValueError(_json_array_message(path, line_no))  # a one-line [{...}, ...]
        example = _parse(record, where, fallback)
        if example.id in first_line:
            raise ValueError(f"{where} repeats id {example.id!r} of line "
                             f"{first_line[example.id]}; ids must be unique (the "
                             f"train/val split and the logs key on them)")
        first_line[example.id] = line_no
        examples.append(example)
        if not any(normalize_answer(a) for a in example.answers):
            unscorable.append(example.id)
        if limit is not None and len(examples) >= limit:
            break  # lines after the last one wanted are not read
    if not examples:  # limit 0 returned above: the file has no record at all
        content = "0 bytes" if path.stat().st_size == 0 else "only blank lines"
        raise ValueError(f"QA file {path} is empty ({content}): it has no question to load; "
                         f"point the flag that names it (--data.task.init_args.train, or a set's "
                         f"path in --data.task.init_args.val) at a QA JSONL with records, "
                         f"{_SCHEMA}")
    if unscorable:
        more = f" and {len(unscorable) - 3} more" if len(unscorable) > 3 else ""
        log.warning("%s: %d question(s) have no answer that survives answer normalisation "
                    "(lower case, no punctuation, no articles), so no answer can ever score on "
                    "them (reward 0): ids %s%s; they are kept; to score them, give each an "
                    "answer with a letter or digit", path, len(unscorable),
                    ", ".join(repr(i) for i in unscorable[:3]), more)
    return examples


def _unit_hash(seed: int, example_id: str) -> float:
    """A number in [0, 1) fixed by (seed, id)."""
    digest = hashlib.sha256(f"{seed}\x00{example_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64


def split_train_val(examples: list[Example], val_fraction: float,
                    seed: int) -> tuple[list[Example], list[Example]]:
    """(train, val), each in input order; ``val`` holds about ``val_fraction`` of examples."""
    if not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"val_fraction ({val_fraction}) must be in [0, 1]")
    train, val = [], []
    for example in examples:
        (val if _unit_hash(seed, example.id) < val_fraction else train).append(example)
    return train, val
