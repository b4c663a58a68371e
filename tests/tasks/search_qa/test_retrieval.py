"""BM25 retrieval on the real HotpotQA and 2Wiki corpora: recall, both corpus forms, the disk
cache and the errors of a broken corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace_lightning.tasks.search_qa.datasets import load_qa
from trace_lightning.tasks.search_qa.retrieval import BM25Retriever, Passage, load_corpus
from trace_lightning.tasks.search_qa.retrieval.bm25 import default_cache_dir
from builders import search_datamodule


def recall_at(retriever: BM25Retriever, examples, k: int) -> float:
    """Share of questions with at least one supporting title among the top k."""
    results = retriever.search([e.question for e in examples], k)
    hits = [any(p.title in e.extras["supporting_titles"] for p in ps) for e, ps in zip(examples, results)]
    return sum(hits) / len(hits)


@pytest.fixture(scope="session")
def hotpot_retriever(shared_data, tmp_path_factory) -> BM25Retriever:
    return BM25Retriever(str(shared_data / "hotpotqa" / "corpus.jsonl"),
                         cache_dir=str(tmp_path_factory.mktemp("bm25-hotpot")))


def test_hotpotqa_recall_at_5(shared_data, hotpot_retriever):
    examples = load_qa(shared_data / "hotpotqa" / "dev_distractor.jsonl", limit=300)
    assert len(hotpot_retriever) == 13182
    recall = recall_at(hotpot_retriever, examples, 5)
    print(f"hotpotqa dev[:300] recall@5 = {recall:.3f}")
    # measured 0.957 (BM25 k1=0.9 b=0.4); chance is about 1 - (1 - 2/13182)^5 < 0.001
    assert recall >= 0.90


def test_2wiki_recall_at_5(shared_data, tmp_path):
    retriever = BM25Retriever(str(shared_data / "2wikimultihopqa" / "corpus.jsonl"),
                              cache_dir=str(tmp_path))
    examples = load_qa(shared_data / "2wikimultihopqa" / "dev.jsonl")
    recall = recall_at(retriever, examples, 5)
    print(f"2wikimultihopqa dev recall@5 = {recall:.3f}")
    assert recall >= 0.90  # measured 1.000 over 164 questions and 1,294 passages


def test_results_are_ranked_and_cut_at_topk(hotpot_retriever):
    results = hotpot_retriever.search(["Scott Derrickson director", "Ed Wood film", "the of a"], 4)
    assert len(results) == 3
    for passages in results[:2]:
        assert len(passages) == 4
        scores = [p.score for p in passages]
        assert scores == sorted(scores, reverse=True) and scores[-1] > 0
    assert results[0][0].title == "Scott Derrickson"
    assert results[2] == []  # only stopwords: no passage shares a term with the query
    assert hotpot_retriever.search([], 3) == []
    with pytest.raises(ValueError, match="topk"):
        hotpot_retriever.search(["x"], 0)


def test_contents_form_matches_title_text_form(shared_data, tmp_path):
    passages = load_corpus(shared_data / "hotpotqa" / "corpus.jsonl")[:200]
    ours, flashrag = tmp_path / "ours.jsonl", tmp_path / "flashrag.jsonl"
    ours.write_text("".join(json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n"
                            for p in passages))
    flashrag.write_text("".join(json.dumps({"id": p.id, "contents": f'"{p.title}"\n{p.text}'})
                                + "\n" for p in passages))
    assert load_corpus(flashrag) == passages  # the title is parsed back out of contents
    a = BM25Retriever(str(ours), cache_dir=str(tmp_path / "a"))
    b = BM25Retriever(str(flashrag), cache_dir=str(tmp_path / "b"))
    queries = [f"{p.title} {p.text.split('.')[0]}" for p in passages[:20]]
    assert a.search(queries, 5) == b.search(queries, 5)
    assert [ps[0].id for ps in a.search(queries, 1)][:5] == [p.id for p in passages[:5]]


def test_contents_parsing_edge_cases():
    p = Passage.from_contents("1", '""Weird Al" Yankovic"\nAlfred Yankovic is a singer.\nMore.')
    assert (p.title, p.text) == ('"Weird Al" Yankovic', "Alfred Yankovic is a singer.\nMore.")
    assert Passage.from_contents("2", p.contents) == Passage("2", p.title, p.text)
    q = Passage.from_contents("3", "no quoted title here")  # not FlashRAG's form: all text
    assert (q.title, q.text) == ("", "no quoted title here")


def test_index_is_cached_and_reloaded(shared_data, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    lines = (shared_data / "2wikimultihopqa" / "corpus.jsonl").read_text().splitlines()[:300]
    corpus.write_text("\n".join(lines) + "\n")
    first = BM25Retriever(str(corpus), cache_dir=str(tmp_path / "cache"))
    assert not first.loaded_from_cache and first.index_dir.parent == tmp_path / "cache"
    stamp = {f.name: f.stat().st_mtime_ns for f in first.index_dir.iterdir()}
    second = BM25Retriever(str(corpus), cache_dir=str(tmp_path / "cache"))
    assert second.loaded_from_cache and second.index_dir == first.index_dir
    assert {f.name: f.stat().st_mtime_ns for f in second.index_dir.iterdir()} == stamp
    queries = ["English cricketer", "United States Senator from Montana"]
    assert second.search(queries, 5) == first.search(queries, 5)
    # other BM25 settings or other corpus bytes: another key, a fresh index
    other = BM25Retriever(str(corpus), cache_dir=str(tmp_path / "cache"), k1=1.5)
    assert not other.loaded_from_cache
    corpus.write_text("\n".join(lines[:299]) + "\n")
    third = BM25Retriever(str(corpus), cache_dir=str(tmp_path / "cache"))
    assert not third.loaded_from_cache and len(third) == 299
    assert len(list((tmp_path / "cache").iterdir())) == 3  # no temporary folders left behind


def test_a_broken_cache_is_replaced_once(shared_data, tmp_path, capsys):
    """A cache folder whose meta.json is garbage is ignored, rebuilt and replaced: the next
    start loads it (before, the rename onto the non-empty folder failed silently and every
    start rebuilt)."""
    corpus = tmp_path / "corpus.jsonl"
    lines = (shared_data / "2wikimultihopqa" / "corpus.jsonl").read_text().splitlines()[:50]
    corpus.write_text("\n".join(lines) + "\n")
    first = BM25Retriever(str(corpus), cache_dir=str(tmp_path / "cache"))
    (first.index_dir / "meta.json").write_text("{not json")
    second = BM25Retriever(str(corpus), cache_dir=str(tmp_path / "cache"))
    assert not second.loaded_from_cache and "ignoring unreadable BM25 cache" in capsys.readouterr().out
    third = BM25Retriever(str(corpus), cache_dir=str(tmp_path / "cache"))
    assert third.loaded_from_cache
    assert third.search(["English cricketer"], 3) == first.search(["English cricketer"], 3)
    assert [f.name for f in (tmp_path / "cache").iterdir()] == [first.index_dir.name]


def test_the_index_is_cached_in_the_user_cache_folder_not_beside_the_corpus(
        shared_data, tmp_path, monkeypatch):
    """Without cache_dir the index goes to $XDG_CACHE_HOME/trace-lightning/bm25 (before: a
    .bm25_cache folder written into the data folder); an unset, empty or relative
    XDG_CACHE_HOME means ~/.cache, as the XDG convention says."""
    data = tmp_path / "data"
    data.mkdir()
    lines = (shared_data / "2wikimultihopqa" / "corpus.jsonl").read_text().splitlines()[:50]
    (data / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    retriever = BM25Retriever(str(data / "corpus.jsonl"))
    assert retriever.index_dir.parent == tmp_path / "xdg" / "trace-lightning" / "bm25"
    assert sorted(os.listdir(data)) == ["corpus.jsonl"]  # nothing written into the data folder
    assert BM25Retriever(str(data / "corpus.jsonl")).loaded_from_cache
    home_cache = Path.home() / ".cache" / "trace-lightning" / "bm25"
    for value in ("", "relative/cache"):
        monkeypatch.setenv("XDG_CACHE_HOME", value)
        assert default_cache_dir() == home_cache
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == home_cache


def test_corpus_line_that_is_not_json_is_named(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "1", "title": "A", "text": "alpha"}\n\n{"id": "2", "title": "B",\n')
    # the column on the record's own line (json saw "line 2" when given the line ending)
    with pytest.raises(ValueError, match=r"c\.jsonl line 3 is not JSON \(Expecting property "
                                         r"name enclosed in double quotes: line 1 column 26"):
        BM25Retriever(str(corpus), cache_dir=str(tmp_path))


def test_corpus_line_that_is_not_utf8_is_named(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(b'{"id": "1", "title": "A", "text": "alpha"}\n'
                       b'{"id": "2", "title": "B", "text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"c\.jsonl:2 is not UTF-8"):
        BM25Retriever(str(corpus), cache_dir=str(tmp_path))


def test_corpus_record_without_text_is_named(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "1", "title": "A", "text": "alpha"}\n{"id": "2", "title": "B"}\n')
    with pytest.raises(ValueError, match=r"line 2 \(id '2'\) has neither a string \"contents\""):
        load_corpus(corpus)
    corpus.write_text('{"title": "A", "text": "alpha"}\n')
    with pytest.raises(ValueError, match=r"line 1 has no string \"id\""):
        load_corpus(corpus)


def test_missing_corpus_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"corpus .*nope\.jsonl does not exist"):
        BM25Retriever(str(tmp_path / "nope.jsonl"))


def test_from_documents_in_memory():
    docs = [{"id": "a", "title": "Zorblat River", "text": "The Zorblat flows into Lake Quen."},
            {"id": "b", "contents": '"Lake Quen"\nLake Quen lies north of Varn City.'},
            {"id": "c", "title": "Varn City", "text": "Varn City is the capital of Ostra."}]
    retriever = BM25Retriever.from_documents(docs)
    assert retriever.index_dir is None and len(retriever) == 3
    (hits,) = retriever.search(["Which lake does the Zorblat flow into?"], 2)
    assert [p.id for p in hits] == ["a", "b"]  # "zorblat" (a only) outweighs "lake" (a and b)
    assert hits[1].title == "Lake Quen" and hits[1].text.startswith("Lake Quen lies")
    with pytest.raises(ValueError, match=r"documents\[1\]"):
        BM25Retriever.from_documents([docs[0], {"id": "x"}])


def test_importing_bm25_keeps_jax_off_the_gpu():
    # bm25s imports JAX (when installed) and runs a top-k at import; XLA's default then takes
    # 75% of every GPU (105 of 140 GiB on the H200). Our import must have JAX on the CPU,
    # allocating on demand, unless the process chose otherwise before importing us.
    code = ("import os, trace_lightning.tasks.search_qa.retrieval.bm25; "
            "print(os.environ['JAX_PLATFORMS'], os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])")
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "XLA_PYTHON_CLIENT_PREALLOCATE")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["cpu", "false"]
    env["JAX_PLATFORMS"] = "cuda"  # a process that configured JAX itself keeps its choice
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["cuda", "false"]


def test_a_validation_set_on_the_training_corpus_shares_its_index(shared_data, tmp_path):
    """``EvalSet(corpus=None)`` means the training retriever: one BM25 index in memory, not
    a second copy of the same corpus (wiki-18 is millions of passages)."""

    corpus = str(shared_data / "2wikimultihopqa" / "corpus.jsonl")
    other = tmp_path / "other.jsonl"
    other.write_text('{"id": "1", "title": "T", "text": "another corpus"}\n')
    dm = search_datamodule(train="unused.jsonl", corpus=corpus)
    training = dm.task._retriever(corpus)
    assert dm.task._retriever(None) is training
    assert dm.task._retriever(str(other)) is not training
    assert len(dm.task._retrievers) == 2


def test_a_corpus_without_any_word_is_named(tmp_path):
    """Empty or one-letter passages leave bm25s an empty vocabulary (it failed with "max()
    arg is an empty sequence", naming no file)."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "1", "title": "", "text": "a"}\n{"id": "2", "title": "b", '
                      '"text": ""}\n{"id": "3", "contents": "\\"x\\"\\nthe of"}\n')
    with pytest.raises(ValueError, match=r"corpus .*c\.jsonl has no word to index in any of "
                                         r"its 3 passages: .*one-letter words or English "
                                         r"stopwords"):
        BM25Retriever(str(corpus), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="from_documents has no word to index"):
        BM25Retriever.from_documents([{"id": "1", "title": "", "text": ""}])


def test_a_directory_as_corpus_is_named(shared_data):
    with pytest.raises(IsADirectoryError, match=r"corpus .*hotpotqa is a directory, not a file; "
                                                r"pass the corpus JSONL inside it, e\.g\. "
                                                r".*hotpotqa/corpus\.jsonl"):
        BM25Retriever(str(shared_data / "hotpotqa"))


@pytest.mark.parametrize("name, content", [("vocab.index.json", "[1, 2]"),
                                           ("params.index.json", "3"),
                                           ("params.index.json", "[1]"),
                                           ("meta.json", "[]")])
def test_a_cache_file_of_the_wrong_json_type_is_rebuilt(shared_data, tmp_path, capsys, name,
                                                        content):
    """Valid JSON of the wrong type (a list for a dict) is a broken cache like garbage is:
    warned about and rebuilt (it raised AttributeError or TypeError)."""
    corpus = tmp_path / "corpus.jsonl"
    lines = (shared_data / "2wikimultihopqa" / "corpus.jsonl").read_text().splitlines()[:50]
    corpus.write_text("\n".join(lines) + "\n")
    first = BM25Retriever(str(corpus), cache_dir=str(tmp_path / "cache"))
    (first.index_dir / name).write_text(content)
    second = BM25Retriever(str(corpus), cache_dir=str(tmp_path / "cache"))
    assert not second.loaded_from_cache
    assert "ignoring unreadable BM25 cache" in capsys.readouterr().out
    third = BM25Retriever(str(corpus), cache_dir=str(tmp_path / "cache"))
    assert third.loaded_from_cache
    assert third.search(["English cricketer"], 3) == first.search(["English cricketer"], 3)
