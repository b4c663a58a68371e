"""QA loading (real HotpotQA/2Wiki/NQ files and FlashRAG's form), errors, and the stable split."""

from __future__ import annotations

import json

import pytest

from trace_lightning.tasks.search_qa.datasets import load_qa, split_train_val
from trace_lightning.tasks.base import Example


def write_jsonl(path, records) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def test_load_real_hotpotqa_dev(shared_data):
    examples = load_qa(shared_data / "hotpotqa" / "dev_distractor.jsonl")
    assert len(examples) == 1350 and len({e.id for e in examples}) == 1350
    assert examples[0] == Example(
        id="5a8b57f25542995d1e6f1371",
        question="Were Scott Derrickson and Ed Wood of the same nationality?",
        answers=["yes"], dataset="hotpotqa", extras={"supporting_titles": ["Scott Derrickson", "Ed Wood"]})
    assert all(e.dataset == "hotpotqa" and e.answers and len(e.extras["supporting_titles"]) == 2
               for e in examples)


def test_load_real_2wiki_dev_and_nq_with_limit(shared_data):
    examples = load_qa(shared_data / "2wikimultihopqa" / "dev.jsonl")
    assert len(examples) == 164
    first = examples[0]
    assert (first.question, first.answers, first.dataset) == (
        "Who was born earlier, Silas Hardy or Lee Mantle?", ["Lee Mantle"], "2wikimultihopqa")
    nq = load_qa(shared_data / "nq" / "test_1k.jsonl", limit=10)
    assert len(nq) == 10 and nq[0].id == "nq_test_3283" and nq[0].answers == ["Jesus Christ"]
    assert nq[0].extras.get("supporting_titles", []) == []
    assert load_qa(shared_data / "nq" / "test_1k.jsonl", limit=0) == []


def test_flashrag_form(tmp_path):
    folder = tmp_path / "musique"
    folder.mkdir()
    path = folder / "dev.jsonl"
    write_jsonl(path, [
        {"id": "test_0", "question": "Who wrote Hamlet?", "golden_answers": ["Shakespeare",
                                                                            "William Shakespeare"],
         "metadata": {"supporting_facts": {"title": ["Hamlet", "Hamlet"], "sent_id": [0, 2]}}},
        "",  # blank lines are skipped
        {"id": 1, "question": "How many legs has a spider?", "golden_answers": [8, " "]},
        {"id": "x", "question": "Named?", "golden_answers": ["yes"], "dataset": "strategyqa"},
    ])
    a, b, c = load_qa(path)
    assert a == Example("test_0", "Who wrote Hamlet?", ["Shakespeare", "William Shakespeare"],
                          "musique", {"supporting_titles": ["Hamlet"]})
    # the dataset from the folder; the titles de-duplicated
    assert (b.id, b.answers) == ("1", ["8"])  # numbers become strings, blank aliases dropped
    assert c.dataset == "strategyqa"  # the record's own field wins
    assert [e.dataset for e in load_qa(path, dataset="mq")] == ["mq", "mq", "strategyqa"]


@pytest.mark.parametrize("bad_line, message", [
    ('{"id": "2", "question": "Q?", "answers": ["a"]', r"dev\.jsonl:3 is not JSON"),
    ('{"id": "2", "question": "  ", "answers": ["a"]}', r"dev\.jsonl:3 \(id '2'\) has an empty"),
    ('{"id": "2", "question": "Q?", "answers": []}', r"dev\.jsonl:3 \(id '2'\) has no non-empty"),
    ('{"id": "2", "question": "Q?", "answers": [""]}', r"dev\.jsonl:3 \(id '2'\) has no non-empty"),
    ('{"id": "2", "question": "Q?"}',
     r"dev\.jsonl:3 \(id '2'\) has neither \"answers\" nor \"golden_answers\";"),
    ('{"id": "2", "question": "Q?", "answer": "a"}',
     r"has neither .* \(it has \"answer\": use a list, \"answers\": \[\"...\"\]\)"),
    ('{"id": "2", "question": "Q?", "answers": [NaN]}', r"\"answers\" must be a list of str"),
    ('{"id": "2", "question": "Q?", "answers": ["a", Infinity]}', r"\"answers\" must be a"),
    ('{"id": "2", "question": "Q?", "answers": "a"}', r"dev\.jsonl:3 \(id '2'\): \"answers\" must"),
    ('{"question": "Q?", "answers": ["a"]}', r"dev\.jsonl:3 has no string \"id\""),
    ('["a"]', r"dev\.jsonl:3 is a JSON list"),
    ('{"id": "1", "question": "Q?", "answers": ["a"]}', r"dev\.jsonl:3 repeats id '1' of line 1"),
])
def test_malformed_lines_are_named(tmp_path, bad_line, message):
    path = tmp_path / "dev.jsonl"
    write_jsonl(path, [{"id": "1", "question": "Q?", "answers": ["a"]}, "", bad_line])
    with pytest.raises(ValueError, match=message):
        load_qa(path)


@pytest.mark.parametrize("ending", ["\n", "\r\n"])
def test_bad_json_column_is_on_line_1_of_the_record(tmp_path, ending):
    """json's message is about the line alone: parsed with its line ending, the missing "}"
    was reported at "line 2 column 1"; the file's own line number stays in front."""
    bad = '{"id": "2", "question": "Q?", "answers": ["a"]'  # 46 characters, no closing brace
    path = tmp_path / "dev.jsonl"
    path.write_bytes(ending.join(['{"id": "1", "question": "Q?", "answers": ["a"]}', "", bad,
                                  ""]).encode())
    with pytest.raises(ValueError, match=r"dev\.jsonl:3 is not JSON \(Expecting ',' delimiter: "
                                         r"line 1 column 47 \(char 46\)\); each line must"):
        load_qa(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_an_empty_file_says_it_is_empty(tmp_path, content):
    """Not "holds 0 training questions ... lower --data.allocator.roots" later, in setup:
    no number of roots is small enough for a file without records."""
    path = tmp_path / "train.jsonl"
    path.write_text(content)
    shown = "0 bytes" if not content else "only blank lines"
    with pytest.raises(ValueError, match=rf"QA file .*train\.jsonl is empty \({shown}\): it has "
                                         rf"no question to load; point the flag that names it "
                                         rf"\(--data\.task\.init_args\.train, or a set's path in "
                                         rf"--data\.task\.init_args\.val\)"):
        load_qa(path)
    with pytest.raises(ValueError, match="is empty"):
        load_qa(path, limit=5)
    assert load_qa(path, limit=0) == []  # asking for none is not an error (a disabled set)


@pytest.mark.parametrize("indent", [None, 2])
def test_a_json_array_file_says_how_to_convert_it(shared_data, tmp_path, indent):
    """HotpotQA's official files are one JSON array, pretty-printed ("[" alone on line 1: not
    JSON) or on one line (JSON, but a list): both say so, and the command given converts it."""
    import re
    import subprocess
    import sys

    lines = (shared_data / "nq" / "test_1k.jsonl").read_text().splitlines()[:2]
    path = tmp_path / "hotpot_dev.json"
    path.write_text(json.dumps([json.loads(line) for line in lines], indent=indent) + "\n")
    with pytest.raises(ValueError, match=r"hotpot_dev\.json is one JSON array \(line 1 starts "
                                         r"with '\['\), not JSON Lines \(one object per line\); "
                                         r"convert it, e.g. `python -c ") as err:
        load_qa(path)
    assert "is not JSON" not in str(err.value) and "is a JSON list" not in str(err.value)
    command = re.search(r"`python (.*)`", str(err.value)).group(1)
    subprocess.run(f"{sys.executable} {command}", shell=True, check=True, cwd=tmp_path)
    converted = load_qa(tmp_path / "hotpot_dev.jsonl")
    assert [e.id for e in converted] == ["nq_test_3283", "nq_test_946"]


def test_a_json_array_named_jsonl_is_not_converted_onto_itself(tmp_path):
    path = tmp_path / "dev.jsonl"
    path.write_text('[\n  {"id": "1", "question": "Q?", "answers": ["a"]}\n]\n')
    with pytest.raises(ValueError, match=r"dev\.jsonl > \S*dev\.lines\.jsonl`, and pass "):
        load_qa(path)


@pytest.mark.parametrize("first_line", ['["a", "b"]', "[1, 2]"])
def test_a_first_line_that_is_a_list_of_non_objects_is_a_json_list(tmp_path, first_line):
    """Only a list of objects reads as a JSON array of records; any other non-object keeps
    the line's own message."""
    path = tmp_path / "dev.jsonl"
    write_jsonl(path, [first_line])
    with pytest.raises(ValueError, match=r"dev\.jsonl:1 is a JSON list, not an object"):
        load_qa(path)


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "dev.jsonl"
    path.write_bytes(b'{"id": "1", "question": "Q?", "answers": ["a"]}\n\n'
                     b'{"id": "2", "question": "Caf\xe9?", "answers": ["a"]}\n')  # Latin-1
    with pytest.raises(ValueError, match=r"dev\.jsonl:3 is not UTF-8"):
        load_qa(path)
    assert len(load_qa(path, limit=1)) == 1  # lines before it read as ever


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"QA file .*absent\.jsonl does not exist"):
        load_qa(tmp_path / "absent.jsonl")
    with pytest.raises(IsADirectoryError, match=r"QA file .* is a directory, not a file; pass "
                                                r"the JSONL inside it"):
        load_qa(tmp_path)


def test_gzip_and_byte_order_mark(tmp_path):
    """A gzip file says to decompress it (not "convert from Latin-1"); a UTF-8 byte-order
    mark on line 1 (Windows editors) is skipped."""
    import gzip

    record = b'{"id": "1", "question": "Q?", "answers": ["a"]}\n'
    zipped = tmp_path / "dev.jsonl.gz"
    zipped.write_bytes(gzip.compress(record))
    with pytest.raises(ValueError, match=r"dev\.jsonl\.gz is gzip-compressed.*gunzip -k"):
        load_qa(zipped)
    bom = tmp_path / "dev.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + record)
    assert [e.id for e in load_qa(bom)] == ["1"]


@pytest.mark.parametrize("encoding, bom", [("utf-16-le", b"\xff\xfe"),
                                           ("utf-16-be", b"\xfe\xff")])
def test_a_utf16_file_is_named_utf16_not_latin1(tmp_path, encoding, bom):
    """Windows tools save "Unicode" text as UTF-16 with a byte-order mark; converting it
    from Latin-1, as the not-UTF-8 advice says, would garble it."""
    path = tmp_path / "dev.jsonl"
    path.write_bytes(bom + '{"id": "1", "question": "Q?", "answers": ["a"]}\n'.encode(encoding))
    with pytest.raises(ValueError, match=r"dev\.jsonl is UTF-16 .*`iconv -f utf-16 -t utf-8 ") \
            as err:
        load_qa(path)
    assert "latin1" not in str(err.value)


@pytest.mark.parametrize("number, shown", [("2.50", "2.5"), ("1e3", "1000.0"), ("2.0", "2.0")])
def test_an_answer_that_is_a_float_is_refused(tmp_path, number, shown):
    """JSON's 2.50 reads as 2.5: the gold answer would silently change (integers are
    converted, as in test_flashrag_form)."""
    path = tmp_path / "dev.jsonl"
    write_jsonl(path, ['{"id": "1", "question": "Q?", "answers": ["two", %s]}' % number])
    with pytest.raises(ValueError, match=rf"dev\.jsonl:1 \(id '1'\): \"answers\" must be a list "
                                         rf"of strings, and it holds the number {shown},.* "
                                         rf"write it as a string, as it should be matched"):
        load_qa(path)


def test_questions_no_answer_can_score_on_are_kept_with_one_warning(tmp_path, caplog):
    """"---", ")" and "The" normalise to "" (no punctuation, no articles): no answer can
    match them. "*" beside a real alias is fine."""
    path = tmp_path / "dev.jsonl"
    write_jsonl(path, [{"id": f"q{i}", "question": "Q?", "answers": answers}
                       for i, answers in enumerate([["---"], ["Paris"], [")", " The "], ["*", "x"],
                                                    ["!"], ["?"], ["ok"]])])
    with caplog.at_level("WARNING", logger="trace_lightning.tasks.search_qa.datasets"):
        examples = load_qa(path)
    assert [e.id for e in examples] == [f"q{i}" for i in range(7)]  # all kept
    (record,) = caplog.records
    assert record.getMessage() == (
        f"{path}: 4 question(s) have no answer that survives answer normalisation (lower case, "
        f"no punctuation, no articles), so no answer can ever score on them (reward 0): ids "
        f"'q0', 'q2', 'q4' and 1 more; they are kept; to score them, give each an answer with "
        f"a letter or digit")
    caplog.clear()
    with caplog.at_level("WARNING", logger="trace_lightning.tasks.search_qa.datasets"):
        load_qa(path, limit=2)  # only the questions read count
    assert "1 question(s)" in caplog.text and "ids 'q0';" in caplog.text


def test_the_real_nq_file_has_two_questions_no_answer_can_score_on(shared_data, caplog):
    with caplog.at_level("WARNING", logger="trace_lightning.tasks.search_qa.datasets"):
        assert len(load_qa(shared_data / "nq" / "test_1k.jsonl")) == 1000
    (record,) = caplog.records
    assert ": 2 question(s) have no answer" in record.getMessage()
    assert "ids 'nq_test_1420', 'nq_test_664';" in record.getMessage()


def test_split_is_stable_disjoint_and_near_the_fraction(shared_data):
    examples = load_qa(shared_data / "hotpotqa" / "dev_distractor.jsonl")
    train, val = split_train_val(examples, val_fraction=0.1, seed=0)
    assert {e.id for e in train}.isdisjoint(e.id for e in val)
    assert len(train) + len(val) == len(examples)
    # Binomial(1350, 0.1): mean 135, sd sqrt(1350 * 0.1 * 0.9) = 11; allow 3 sd
    assert 135 - 33 <= len(val) <= 135 + 33
    assert split_train_val(examples, 0.1, seed=0) == (train, val)  # deterministic
    assert [e.id for e in val] != [e.id for e in split_train_val(examples, 0.1, seed=1)[1]]
    # adding examples does not move the others: split a subset, then the whole
    _, val_subset = split_train_val(examples[:500], 0.1, seed=0)
    assert val_subset == [e for e in val if e in examples[:500]]
    assert split_train_val(examples, 0.0, seed=0) == (examples, [])
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(examples, 1.5, seed=0)
