"""The agent format and the search environment: ``parse_turn`` on a table of malformed and
valid turns, and ``SearchEnvironment`` with a tokenizer trained here and a real BM25 index
over the real HotpotQA passages."""

from __future__ import annotations

import copy

import pytest

from trace_lightning.tasks.search_qa.environment import (
    SEARCH_R1_INSTRUCTION,
    STOP_STRINGS,
    SearchEnvironment,
    format_passages,
    parse_turn,
)
from trace_lightning.tasks.base import Example, Turn, through_first_stop
from trace_lightning.models import train_tokenizer
from trace_lightning.tasks.search_qa.tiny_policy import AGENT_TAGS, read_corpus_texts
from trace_lightning.tasks.search_qa.retrieval import BM25Retriever, Passage

EOS = "<|im_end|>"


def scores(env: SearchEnvironment, final: Turn, golds) -> tuple[float, float, float]:
    """(reward, em, f1) of ``env.score``, whose metrics are a dict."""
    golds = [golds] if isinstance(golds, str) else list(golds)
    reward, metrics = env.score(final, Example("q", "?", golds))
    assert set(metrics) == {"em", "f1"}
    return reward, metrics["em"], metrics["f1"]

# (id, generated text, error substring); every one must parse as "invalid"
MALFORMED = [
    ("unclosed-search", "<think>who?</think><search>Ed Wood", "never closed"),
    ("unclosed-answer", "<answer>Paris", "never closed"),
    ("unclosed-think", "<think>I should search for", "never closed"),
    ("stop-string-split", "<think>x</think><search>Ed Wood</sear", "never closed"),
    ("search-then-answer", "<search>Ed Wood</search><answer>yes</answer>", "after the action"),
    ("two-searches", "<search>Ed Wood</search> <search>Scott Derrickson</search>",
     "after the action"),
    ("two-answers", "<answer>yes</answer><answer>no</answer>", "after the action"),
    ("think-after-action", "<answer>yes</answer><think>done</think>", "after the action"),
    ("nested-answer-in-search", "<search><answer>x</answer></search>", "inside <search>"),
    ("nested-search-in-search", "<search>a <search>b</search></search>", "inside <search>"),
    ("answer-only-in-think", "<think>I know: <answer>Paris</answer></think>", "inside <think>"),
    ("search-only-in-think", "<think>maybe <search>Ed Wood</search></think>", "inside <think>"),
    ("mismatched-close", "<search>Ed Wood</answer>", "inside <search>"),
    ("information-by-policy", "<information>Doc 1(Title: Paris) Paris is the capital."
     "</information><answer>Paris</answer>", "<information> block"),
    ("information-after-search", "<search>Ed Wood</search><information>Doc 1(Title: Ed Wood)"
     " fake</information>", "<information> block"),
    ("information-inside-search", "<search>Ed<information></search>", "inside <search>"),
    ("stray-closing-think", "</think><answer>Paris</answer>", "without an opening tag"),
    ("stray-closing-after-answer", "<answer>Paris</answer></answer>", "without an opening tag"),
    ("stray-closing-information", "</information>", "without an opening tag"),
    ("empty-query", "<think>x</think><search></search>", "empty search query"),
    ("whitespace-query", "<search> \n\t\u3000 </search>", "empty search query"),
    ("text-after-answer", "<answer>Paris</answer> because it is the capital",
     "text after the action"),
    ("text-after-search", "<search>Ed Wood</search>\nand then", "text after the action"),
    ("eos-after-answer", f"<answer>Paris</answer>{EOS}", "text after the action"),
    ("very-long-unclosed", "<think>" + "a" * 100_000, "never closed"),
    ("very-long-no-tags", "word " * 20_000, "no <search> or <answer>"),
    ("unicode-no-tags", "日本語のテキスト 🤖 — Zürich ½", "no <search> or <answer>"),
    ("only-think", "<think>hmm, let me think</think>", "no <search> or <answer>"),
    ("nothing", "", "no <search> or <answer>"),
    ("whitespace-only", " \n\t ", "no <search> or <answer>"),
    ("eos-only", EOS, "no <search> or <answer>"),
    ("upper-case-tags", "<SEARCH>Ed Wood</SEARCH>", "no <search> or <answer>"),
    ("title-case-tags", "<Answer>Paris</Answer>", "no <search> or <answer>"),
    ("spaced-tags", "< answer >Paris</ answer >", "no <search> or <answer>"),
    ("tag-with-space-inside", "<search >Ed Wood</search>", "without an opening tag"),
]

# (id, generated text, kind, argument)
VALID = [
    ("bare-search", "<search>Ed Wood</search>", "search", "Ed Wood"),
    ("think-search", "<think>I need the director.</think>\n<search>Ed Wood director</search>",
     "search", "Ed Wood director"),
    ("normalised-query", "<search>  Ed \n Wood\t  film </search>", "search", "Ed Wood film"),
    ("bare-answer", "<answer>yes</answer>", "answer", "yes"),
    ("think-answer", "<think>Both are American.</think> <answer> yes </answer>\n\n",
     "answer", "yes"),
    ("two-thinks", "<think>a</think>\n<think>b</think>\n<answer> Tim  Burton </answer>",
     "answer", "Tim Burton"),
    ("empty-think", "<think></think><answer>Chief of Protocol</answer>", "answer",
     "Chief of Protocol"),
    ("empty-answer", "<answer></answer>", "answer", ""),
    ("whitespace-answer", "<think>?</think><answer>  \n </answer>", "answer", ""),
    ("unicode-answer", "<answer> Zürich\u3000東京 </answer>", "answer", "Zürich 東京"),
    ("long-think", "<think>" + "word " * 20_000 + "</think><answer>x</answer>", "answer", "x"),
    ("angle-brackets-in-answer", "<answer>a < b > c</answer>", "answer", "a < b > c"),
    ("text-before-action", "Sure. <think>a</think>so<answer>Paris</answer>", "answer", "Paris"),
]


@pytest.mark.parametrize("text, error", [pytest.param(t, e, id=i) for i, t, e in MALFORMED])
def test_malformed_turns_are_invalid(text, error):
    action = parse_turn(text)
    assert action.kind == "invalid"
    assert action.argument == ""
    assert error in action.error


@pytest.mark.parametrize("text, kind, argument",
                         [pytest.param(t, k, a, id=i) for i, t, k, a in VALID])
def test_valid_turns(text, kind, argument):
    action = parse_turn(text)
    assert (action.kind, action.argument, action.error) == (kind, argument, "")


def test_tables_are_large_enough():
    assert len(MALFORMED) >= 20 and len({i for i, *_ in MALFORMED}) == len(MALFORMED)


# ---- the environment ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(shared_data):
    return shared_data / "hotpotqa" / "corpus.jsonl"


@pytest.fixture(scope="module")
def tokenizer(corpus):
    texts = read_corpus_texts(corpus, 300) + [" ".join(AGENT_TAGS)]
    return train_tokenizer(texts, 1024, AGENT_TAGS)


@pytest.fixture(scope="module")
def retriever(corpus, tmp_path_factory):
    # one cache folder per test session: the rollout tests load the index built here
    return BM25Retriever(str(corpus), cache_dir=str(tmp_path_factory.getbasetemp() / "bm25"))


@pytest.fixture(scope="module")
def env(tokenizer, retriever):
    return SearchEnvironment(tokenizer, retriever, topk=3, max_obs_tokens=10_000)


QUESTION = "Were Scott Derrickson and Ed Wood of the same nationality?"


def test_prompt_uses_the_chat_template(env, tokenizer):
    ids, text = env.prompt("  " + QUESTION + " \n")
    plain = SEARCH_R1_INSTRUCTION.format(question=QUESTION)
    assert text == f"<|im_start|>user\n{plain}<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids
    assert tokenizer.decode(ids) == text


def test_prompt_without_chat_template(tokenizer, retriever):
    plain = SEARCH_R1_INSTRUCTION.format(question=QUESTION)
    env = SearchEnvironment(tokenizer, retriever, use_chat_template=False)
    ids, text = env.prompt(QUESTION)
    assert text == plain and "<|im_start|>" not in text
    assert ids == tokenizer.encode(plain, add_special_tokens=False)
    # a tokenizer without a chat template gets the plain prompt even when asked for one
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    assert SearchEnvironment(bare, retriever, use_chat_template=True).prompt(QUESTION)[1] == plain


def test_custom_instruction(tokenizer, retriever):
    env = SearchEnvironment(tokenizer, retriever, instruction="Q: {question}\nA:",
                            use_chat_template=False)
    assert env.prompt("Who?")[1] == "Q: Who?\nA:"


def test_instruction_may_hold_other_braces(tokenizer, retriever):
    env = SearchEnvironment(tokenizer, retriever, use_chat_template=False,
                            instruction='Reply like {"answer": "..."}.\nQ: {question}\n')
    assert env.prompt("Who?")[1] == 'Reply like {"answer": "..."}.\nQ: Who?\n'


@pytest.mark.parametrize("text, turn", [
    # the engine stopped on a token that completed the stop string and carries more text
    ("<think>x</think><answer>Paris</answer>.", "<think>x</think><answer>Paris</answer>"),
    ("<search>Ed Wood</search>,\n", "<search>Ed Wood</search>"),
    # the first stop string ends the turn, as it ended generation
    ("<search>a</search><answer>b</answer>", "<search>a</search>"),
    ("<think>no stop yet", "<think>no stop yet"),
])
def test_a_turn_ends_at_its_first_stop_string(text, turn):
    assert through_first_stop(text, STOP_STRINGS) == turn
    if turn.endswith("</answer>"):
        assert parse_turn(text).kind == "invalid"  # what the whole token's text would give
        assert parse_turn(through_first_stop(text, STOP_STRINGS)) == Turn("answer", "Paris")


def test_prompt_example_answer_is_never_scored(env):
    """The instruction shows ``<answer> Beijing </answer>``; a question whose gold is Beijing
    earns nothing unless the policy itself answers Beijing."""
    golds = ["Beijing", "Peking"]
    _, prompt = env.prompt("What is the capital of China?")
    assert "<answer> Beijing </answer>" in prompt
    assert parse_turn(prompt).kind == "invalid"  # even the whole prompt is no answer
    for generated in ["", "<think>I know this.</think>", "<think>capital</think><search>"
                      "capital of China</search>", "<answer>Shanghai</answer>", "Beijing",
                      "<answer> Beijing"]:
        assert scores(env, parse_turn(generated), golds) == (0.0, 0.0, 0.0), generated
    assert scores(env, parse_turn("<think>x</think><answer> Beijing </answer>"),
                     golds) == (1.0, 1.0, 1.0)
    assert scores(env, parse_turn("<answer>peking.</answer>"), golds) == (1.0, 1.0, 1.0)


def test_empty_answer_scores_zero(env):
    action = parse_turn("<answer></answer>")
    assert action == Turn("answer", "")
    assert scores(env, action, ["Paris"]) == (0.0, 0.0, 0.0)
    # a search or an invalid turn as the final action also scores 0, whatever its text
    assert scores(env, Turn("search", "Paris"), ["Paris"]) == (0.0, 0.0, 0.0)
    assert scores(env, Turn("invalid", "Paris", error="x"), ["Paris"]) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("kind, threshold, answer, want", [
    # gold "Barack Obama": "Obama" has precision 1, recall 1/2 -> F1 = 2 * 1/2 / (3/2) = 2/3
    ("em", 0.3, "Obama", 0.0),
    ("f1", 0.3, "Obama", 2 / 3),
    ("f1_threshold", 0.3, "Obama", 1.0),  # 2/3 >= 0.3
    ("f1_threshold", 0.7, "Obama", 0.0),  # 2/3 < 0.7
    ("f1_threshold", 2 / 3, "Obama", 1.0),  # the threshold itself passes
    # "The Barack Obama." normalises to "barack obama": EM 1, F1 1
    ("em", 0.3, "The Barack Obama.", 1.0),
    ("f1", 0.3, "The Barack Obama.", 1.0),
    # "president Barack Obama": precision 2/3, recall 1 -> F1 = 2 * 2/3 / (5/3) = 4/5
    ("f1", 0.3, "president Barack Obama", 0.8),
    ("em", 0.3, "president Barack Obama", 0.0),
    # a second alias matches exactly
    ("em", 0.3, "Barry", 1.0),
    # no shared token
    ("f1", 0.3, "George Bush", 0.0),
    ("f1_threshold", 0.01, "George Bush", 0.0),  # F1 0 < any allowed threshold
])
def test_reward_kinds(tokenizer, retriever, kind, threshold, answer, want):
    env = SearchEnvironment(tokenizer, retriever, reward=kind, f1_threshold=threshold)
    reward, em, f1 = scores(env, parse_turn(f"<answer>{answer}</answer>"),
                               ["Barack Obama", "Barry"])
    assert reward == pytest.approx(want, abs=1e-12)
    assert 0.0 <= em <= f1 <= 1.0


def test_yes_no_answers(env):
    # HotpotQA's rule: "no" earns nothing against "yes", not even F1
    assert scores(env, parse_turn("<answer>no</answer>"), ["yes"]) == (0.0, 0.0, 0.0)
    assert scores(env, parse_turn("<answer>Yes.</answer>"), ["yes"]) == (1.0, 1.0, 1.0)


def test_observation_format(env, retriever, tokenizer):
    queries = ["Scott Derrickson director", "Ed Wood 1994 film"]
    out = env.observe(queries)
    assert len(out) == 2
    for q, (ids, text) in zip(queries, out):
        passages = retriever.search([q], 3)[0]
        assert len(passages) == 3
        body = "".join(f"Doc {i + 1}(Title: {p.title}) {p.text}\n"
                       for i, p in enumerate(passages))
        assert body == format_passages(passages)
        assert text == f"\n\n<information>{body}</information>\n\n"
        assert tokenizer.decode(ids) == text
        assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert "Doc 1(Title: Scott Derrickson)" in out[0][1]
    assert env.observe([]) == []


@pytest.mark.parametrize("flag, value", [("topk", 0), ("max_turns", 0), ("max_obs_tokens", -1),
                                         ("max_seq_tokens", 0), ("max_query_chars", 0)])
def test_limits_below_their_least_name_the_flag(tokenizer, retriever, flag, value):
    with pytest.raises(ValueError,
                       match=rf"--data.task.init_args.env.{flag} \({value}\) must be >="):
        SearchEnvironment(tokenizer, retriever, **{flag: value})


@pytest.mark.parametrize("topk", [1, 2, 5])
def test_observation_holds_topk_passages(tokenizer, retriever, topk):
    env = SearchEnvironment(tokenizer, retriever, topk=topk, max_obs_tokens=10_000)
    ((_, text),) = env.observe(["Silas Hardy English cricketer"])
    assert text.count("Doc ") == topk and f"Doc {topk}(" in text
    assert f"Doc {topk + 1}(" not in text


class TooManyPassages:
    """A retriever that ignores topk and answers ten passages per query."""

    def search(self, queries, topk):
        return [[Passage(str(i), f"T{i}", f"text {i}") for i in range(10)] for _ in queries]


def test_observation_holds_topk_passages_whatever_the_retriever_answers(tokenizer):
    env = SearchEnvironment(tokenizer, TooManyPassages(), topk=3, max_obs_tokens=10_000)
    ((_, text),) = env.observe(["who"])
    assert text == ("\n\n<information>Doc 1(Title: T0) text 0\nDoc 2(Title: T1) text 1\n"
                    "Doc 3(Title: T2) text 2\n</information>\n\n")


@pytest.mark.parametrize("max_obs_tokens", [0, 1, 12, 40])
def test_observation_is_cut_to_max_obs_tokens(tokenizer, retriever, max_obs_tokens):
    env = SearchEnvironment(tokenizer, retriever, topk=3, max_obs_tokens=max_obs_tokens)
    ids, text = env.observe(["Scott Derrickson director"])[0]
    full = tokenizer.encode(format_passages(retriever.search(["Scott Derrickson director"],
                                                             3)[0]), add_special_tokens=False)
    assert len(full) > 40
    head = tokenizer.encode("\n\n<information>", add_special_tokens=False)
    tail = tokenizer.encode("</information>\n\n", add_special_tokens=False)
    assert ids == head + full[:max_obs_tokens] + tail  # the body, cut to max_obs_tokens
    assert text.startswith("\n\n<information>") and text.endswith("</information>\n\n")
    if max_obs_tokens >= 12:
        assert text.startswith("\n\n<information>Doc 1(Title: ")


def test_empty_retrieval_is_an_empty_observation(env, tokenizer):
    # only stopwords: BM25 returns no passage, which is a valid (empty) observation
    ((ids, text),) = env.observe(["the of a"])
    assert text == "\n\n<information></information>\n\n"
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert parse_turn("<search>the of a</search>").kind == "search"


def test_bad_instruction_is_a_clear_error(tokenizer, retriever):
    with pytest.raises(ValueError, match=r"--data.task.init_args.env.instruction must contain "
                                         r"'\{question\}'"):
        SearchEnvironment(tokenizer, retriever, instruction="Answer: {query}")


def test_bad_reward_kind_is_a_clear_error(tokenizer, retriever):
    with pytest.raises(ValueError, match="--data.task.init_args.env.reward .'accuracy'. must be "
                                         "one of 'em', 'f1', 'f1_threshold'"):
        SearchEnvironment(tokenizer, retriever, reward="accuracy")


def test_bad_f1_threshold_fails_at_construction(tokenizer, retriever):
    with pytest.raises(ValueError, match="f1_threshold"):
        SearchEnvironment(tokenizer, retriever, reward="f1_threshold", f1_threshold=1.5)
    # at 0 a missing answer (F1 0) would earn reward 1
    with pytest.raises(ValueError, match=r"--data.task.init_args.env.f1_threshold \(0.0\) must be "
                                         r"in \(0, 1\]"):
        SearchEnvironment(tokenizer, retriever, reward="f1_threshold", f1_threshold=0.0)


def test_stop_string_made_a_special_token_is_refused(corpus, retriever):
    """Engines decode without special tokens when they look for stop strings: a tokenizer
    that makes </answer> special would let a turn run past its answer, and the junk after it
    would be trained on. Refused at construction, with the fix."""
    tokenizer = train_tokenizer(read_corpus_texts(corpus, 50), 400, AGENT_TAGS)
    SearchEnvironment(tokenizer, retriever)  # the tags as normal tokens: fine
    tokenizer.add_special_tokens({"additional_special_tokens": ["</answer>"]})
    with pytest.raises(ValueError, match=r"makes '</answer>' a special token.*special_tokens=False"):
        SearchEnvironment(tokenizer, retriever)


@pytest.mark.parametrize("setting, message", [
    ({"topk": 0}, r"--data.task.init_args.env.topk \(0\) must be >= 1"),
    ({"max_seq_tokens": 0}, r"--data.task.init_args.env.max_seq_tokens \(0\) must be >= 1"),
    ({"instruction": "no placeholder"},
     r"--data.task.init_args.env.instruction must contain '\{question\}'"),
    ({"reward": "f1_threshold", "f1_threshold": float("nan")},
     r"--data.task.init_args.env.f1_threshold \(nan\) must be in \(0, 1\]"),
])
def test_env_config_refuses_what_the_environment_would_when_configured(setting, message):
    """The run's --data.task.init_args.env settings are checked as the CLI builds them, not
    when the first environment is made (after the tokenizer, the corpus index and the
    engine)."""
    from trace_lightning.tasks.search_qa.config import EnvConfig

    with pytest.raises(ValueError, match=message):
        EnvConfig(**setting)
    EnvConfig(instruction=None)  # None: Search-R1's instruction, which has {question}


# ---- describing a prompt to the predictor -------------------------------------------------

class Listed:
    """A retriever that answers each query with the titles listed for it, best first."""

    def __init__(self, titles: dict[str, list[str]]):
        self.titles, self.calls = titles, 0

    def search(self, queries, topk):
        self.calls += 1
        return [[Passage(t, t, "") for t in self.titles.get(q, [])] for q in queries]


def test_prompt_features_by_hand(tokenizer):
    from trace_lightning.tasks.base import Example
    from trace_lightning.tasks.search_qa.environment import PROMPT_FEATURES
    retriever = Listed({
        "Ama": ["Ama", "Amabel"],            # shown, first
        "Bo": ["Boris", "Bo Len", "Bo"],     # shown (third of topk 3), not first
        "Cid": ["Cid Ola", "Cido", "Cidar", "Cid"],  # the fourth: not shown at topk 3
        "Who met Ama and Cid?": ["Cid", "Ama Ola", "Bo"],
    })
    env = SearchEnvironment(tokenizer, retriever, topk=3)
    ex = Example("q1", "Who met Ama and Cid?", ["x"], extras={"supporting_titles": ["Ama", "Bo", "Cid"]})
    # shown: Ama, Bo (2 of 3); first: Ama (1 of 3); the question's search shows Bo and Cid
    assert env.prompt_features(ex) == pytest.approx([2 / 3, 1 / 3, 2 / 3])
    assert len(env.prompt_features(ex)) == len(PROMPT_FEATURES)
    assert retriever.calls == 1  # the second call was cached
    # no supporting titles (NQ): nothing to find, zeros, no retriever call
    assert env.prompt_features(Example("q2", "Who?", ["x"])) == [0.0, 0.0, 0.0]
    assert retriever.calls == 1
    with pytest.raises(RuntimeError, match="without a retriever"):
        SearchEnvironment(tokenizer, None).prompt_features(ex)


def test_prompt_features_with_bm25_match_searches_one_at_a_time(env, retriever):
    from trace_lightning.tasks.base import Example
    titles = ["Scott Derrickson", "Ed Wood", "Tyler Bates"]
    ex = Example("5a8b57f25542995d1e6f1371", QUESTION, ["yes"], dataset="hotpotqa",
                 extras={"supporting_titles": titles})
    got = env.prompt_features(ex)
    # reference: each search on its own, read by hand
    shown = first = asked = 0
    (by_question,) = retriever.search([QUESTION], env.topk)
    for t in titles:
        (passages,) = retriever.search([t], env.topk)
        shown += t in [p.title for p in passages[:env.topk]]
        first += passages[0].title == t
        asked += t in [p.title for p in by_question[:env.topk]]
    assert got == pytest.approx([shown / 3, first / 3, asked / 3])
    assert 0 < got[0]  # a title's own search finds some of them in this corpus


def test_an_agent_loop_gives_new_trees_their_prompt_features_when_asked(tokenizer):
    from trace_lightning.rollout.agent import AgentLoop
    from trace_lightning.rollout.engines.base import SamplingConfig
    from trace_lightning.tasks.base import Example
    from trace_lightning.tree import RolloutTree
    env = SearchEnvironment(tokenizer, Listed({"Ama": ["Ama"], "Who is Ama?": ["Bo"]}), topk=2)
    ex = Example("q", "Who is Ama?", ["x"], extras={"supporting_titles": ["Ama"]})
    tree = AgentLoop(None, env, SamplingConfig(), describe=True).new_tree(ex)
    assert tree.prompt_features == [1.0, 1.0, 0.0]
    assert RolloutTree.from_dict(tree.to_dict()).prompt_features == [1.0, 1.0, 0.0]
    assert AgentLoop(None, env, SamplingConfig()).new_tree(ex).prompt_features == []
