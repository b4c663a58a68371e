"""In-process BM25 retrieval over a corpus JSONL (bm25s), with the index cached on disk.

Each passage is indexed as ``title + "\\n" + text`` (what Search-R1's Pyserini index holds
as ``contents``). Tokens: lower case, scikit-learn's ``\\b\\w\\w+\\b`` pattern, bm25s's English
stopwords, no stemmer (bm25s's stemming needs PyStemmer, a dependency we do not take).
Scoring: Lucene BM25 with Pyserini's defaults ``k1=0.9, b=0.4``.

Cache: the index of a corpus file is saved under ``<cache_dir>/bm25-<stem>-<key>`` where the
key is the sha256 of the corpus file's bytes plus the tokenizer and BM25 settings, so an
edited file or another setting gets a fresh index and a later construction just loads it.
Without ``cache_dir`` the cache lives in the user's cache folder (:func:`default_cache_dir`:
``$XDG_CACHE_HOME/trace-lightning/bm25``, else ``~/.cache/trace-lightning/bm25``), never in
the data folder. An index is written to a temporary folder and renamed into place, so
concurrent processes never read a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Literal, get_args

# bm25s imports JAX when it is installed and runs a dummy top-k at import, so XLA's default
# preallocates 75% of every visible GPU for JAX inside our training process, memory the
# policy and the engine need. BM25 needs no GPU: JAX stays on the CPU and allocates on
# demand, unless the process has configured JAX itself (set these before importing us).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import bm25s  # noqa: E402
import numpy as np  # noqa: E402

from trace_lightning.jsonl import jsonl_lines
from trace_lightning.tasks.search_qa.retrieval import DOCUMENT_FORMS, Passage

TOKEN_PATTERN = r"(?u)\b\w\w+\b"
STOPWORDS = "en"
CACHE_FORMAT = 1  # bump when the cached layout or the tokenizer changes
_FORMS = "each line must be " + DOCUMENT_FORMS
Method = Literal["lucene", "robertson", "atire", "bm25l", "bm25+"]


def load_corpus(path: str | os.PathLike) -> list[Passage]:
    """Read a corpus JSONL in our form or FlashRAG's; blank lines are skipped."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"corpus {path} is a directory, not a file; pass the corpus JSONL "
                                f"inside it, e.g. {path / 'corpus.jsonl'}")
    if not path.is_file():
        raise FileNotFoundError(f"corpus {path} does not exist; pass the path of a JSONL file "
                                f"whose lines are {DOCUMENT_FORMS} "
                                f"(e.g. ../shared/data/hotpotqa/corpus.jsonl)")
    passages = []
    for line_no, line in jsonl_lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"corpus {path} line {line_no} is not JSON ({e}); "
                             f"{_FORMS}") from None
        passages.append(Passage.from_record(record, f"corpus {path} line {line_no}"))
    if not passages:
        raise ValueError(f"corpus {path} holds no documents; {_FORMS}")
    return passages


def _tokenize(texts: list[str]) -> list[list[str]]:
    return bm25s.tokenize(texts, lower=True, token_pattern=TOKEN_PATTERN, stopwords=STOPWORDS,
                          stemmer=None, return_ids=False, show_progress=False)


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/trace-lightning/bm25``, else ``~/.cache/trace-lightning/bm25``.

    The XDG base directory convention: an unset, empty or relative ``XDG_CACHE_HOME`` is
    ignored. Read when called, so a process may set it before building a retriever.
    """
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return root / "trace-lightning" / "bm25"


class BM25Retriever:
    """BM25 over a corpus JSONL, searched in-process; the index is cached on disk.

    Args:
        corpus: path of the corpus JSONL (``{"id","title","text"}`` or ``{"id","contents"}`` lines).
        cache_dir: index cache folder; None = the user's cache folder,
            ``$XDG_CACHE_HOME/trace-lightning/bm25`` else ``~/.cache/trace-lightning/bm25``.
        k1: BM25 term-frequency saturation.
        b: BM25 length normalisation.
        method: bm25s scoring variant.
    """

    def __init__(self, corpus: str, cache_dir: str | None = None, k1: float = 0.9,
                 b: float = 0.4,
                 method: Method = "lucene"):
        corpus_path = Path(corpus)
        self._setup(load_corpus(corpus_path), k1, b, method)
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.index_dir = root / f"bm25-{corpus_path.stem}-{self._cache_key(corpus_path)[:20]}"
        self.loaded_from_cache = self._load_index(self.index_dir)
        if not self.loaded_from_cache:
            self._build_index(f"corpus {corpus_path}")
            self._save_index(self.index_dir)

    @classmethod
    def from_documents(cls, docs: Iterable[dict], k1: float = 0.9, b: float = 0.4,
                       method: Method = "lucene") -> BM25Retriever:
        """An in-memory index (not cached) over documents in either corpus form."""
        self = cls.__new__(cls)
        passages = [Passage.from_record(d, f"documents[{i}]") for i, d in enumerate(docs)]
        if not passages:
            raise ValueError("from_documents got no documents; pass a non-empty list of "
                             "{\"id\", \"title\", \"text\"} or {\"id\", \"contents\"} dicts")
        self._setup(passages, k1, b, method)
        self.index_dir, self.loaded_from_cache = None, False
        self._build_index("from_documents")
        return self

    def _setup(self, passages: list[Passage], k1: float, b: float, method: str) -> None:
        if k1 < 0 or not 0 <= b <= 1:
            raise ValueError(f"BM25 k1 ({k1}) must be >= 0 and b ({b}) in [0, 1]; "
                             f"Pyserini's defaults are k1=0.9, b=0.4")
        if method not in get_args(Method):
            raise ValueError(f"BM25 method {method!r} is not one of {get_args(Method)}")
        self.passages = passages
        self.k1, self.b, self.method = k1, b, method
        self._bm25: bm25s.BM25 | None = None

    def __len__(self) -> int:
        return len(self.passages)

    # -- index ----------------------------------------------------------------------------

    def _settings(self) -> dict:
        return {"format": CACHE_FORMAT, "bm25s": bm25s.__version__, "lower": True,
                "token_pattern": TOKEN_PATTERN, "stopwords": STOPWORDS, "stemmer": None,
                "fields": "title\\ntext", "k1": self.k1, "b": self.b, "method": self.method}

    def _cache_key(self, corpus: Path) -> str:
        digest = hashlib.sha256()
        with corpus.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        digest.update(json.dumps(self._settings(), sort_keys=True).encode())
        return digest.hexdigest()

    def _build_index(self, source: str) -> None:
        """Index the passages; ``source`` names them in the error of a corpus without words."""
        tokens = _tokenize([f"{p.title}\n{p.text}" for p in self.passages])
        if not any(tokens):  # bm25s would fail with "max() arg is an empty sequence"
            raise ValueError(f"{source} has no word to index in any of its {len(tokens)} "
                             f"passages: all titles and texts are empty, one-letter words or "
                             f"English stopwords; pass a corpus whose passages hold their text")
        self._bm25 = bm25s.BM25(k1=self.k1, b=self.b, method=self.method, backend="numpy")
        self._bm25.index(tokens, show_progress=False)

    def _load_index(self, index_dir: Path, quiet: bool = False) -> bool:
        """Load a cached index; False when there is none or it does not fit this corpus."""
        meta_path = index_dir / "meta.json"
        if not meta_path.is_file():
            return False
        n = len(self.passages)
        try:
            meta = json.loads(meta_path.read_text())
            bm25 = bm25s.BM25.load(str(index_dir), load_vocab=True, show_progress=False)
            fits = meta.get("num_docs") == n and bm25.scores["num_docs"] == n
        # valid JSON of the wrong type (a list for a dict) fails as AttributeError/TypeError
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            if not quiet:
                print(f"[trace-lightning] ignoring unreadable BM25 cache {index_dir} "
                      f"({type(e).__name__}: {e}); rebuilding")
            return False
        if not fits:
            return False
        self._bm25 = bm25
        return True

    def _save_index(self, index_dir: Path) -> None:
        """Write to a temporary sibling folder, then rename it into place.

        A folder already there that does not load (unreadable, or another corpus's: why
        this index was built) is moved aside and deleted, else every start would rebuild;
        one that loads was saved by another process meanwhile and is kept.
        """
        try:
            index_dir.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=index_dir.parent))
        except OSError as e:
            print(f"[trace-lightning] cannot cache the BM25 index in {index_dir.parent} ({e}); "
                  f"it is rebuilt on each start. Pass a writable cache_dir to keep it.")
            return
        try:
            self._bm25.save(str(tmp), show_progress=False)
            (tmp / "meta.json").write_text(json.dumps(
                {"num_docs": len(self.passages), "settings": self._settings()}, indent=1))
            try:
                os.replace(tmp, index_dir)
            except OSError:
                if self._load_index(index_dir, quiet=True):
                    return  # another process saved the same index first
                stale = Path(tempfile.mkdtemp(prefix=".stale-", dir=index_dir.parent))
                os.replace(index_dir, stale / "index")
                shutil.rmtree(stale, ignore_errors=True)
                os.replace(tmp, index_dir)
        except OSError as e:
            print(f"[trace-lightning] cannot cache the BM25 index in {index_dir} ({e}); it is "
                  f"rebuilt on each start. Pass a writable cache_dir to keep it.")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # -- search ---------------------------------------------------------------------------

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        """Top ``topk`` passages per query, best first.

        Only passages that share a term with the query are returned, so a query made only of
        stopwords or unknown words gets an empty list, and a list may be shorter than topk.
        """
        if isinstance(queries, str) or not all(isinstance(q, str) for q in queries):
            raise TypeError(f"search expects a list of query strings, got {queries!r:.200}")
        if not isinstance(topk, int) or topk < 1:
            raise ValueError(f"topk ({topk!r}) must be an integer >= 1")
        if not queries:
            return []
        vocab = self._bm25.vocab_dict
        results = []
        for tokens in _tokenize(list(queries)):
            ids = [vocab[t] for t in tokens if t and t in vocab]
            if not ids:
                results.append([])
                continue
            scores = self._bm25.get_scores_from_ids(ids)  # (num_docs,)
            k = min(topk, len(scores))
            top = np.argpartition(-scores, k - 1)[:k]  # (k,) unordered
            top = top[np.argsort(-scores[top], kind="stable")]  # (k,) best first
            results.append([self._hit(int(i), float(scores[i])) for i in top if scores[i] > 0])
        return results

    def _hit(self, index: int, score: float) -> Passage:
        p = self.passages[index]
        return Passage(id=p.id, title=p.title, text=p.text, score=score)
