"""The workload classifier: held-out accuracy, unseen phrasings, the fast path, the shipped artifact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specgate.policies.classes import WORKLOAD_CLASSES
from specgate.policies.classifier import ScoreCache, WorkloadClassifier
from specgate.policies.features import structural
from specgate.policies.request import HEAD_CHARS, TAIL_CHARS, RequestInfo
from specgate.policies.text_model import LinearTextModel
from specgate.policies.training import dataset
from specgate.policies.training.classifier import evaluate, fit, row_info, split_by_group


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return dataset.load()


@pytest.fixture(scope="module")
def shipped() -> WorkloadClassifier:
    return WorkloadClassifier.load()


@pytest.mark.slow
def test_held_out_accuracy_over_every_class(rows: list[dict]) -> None:
    train, test = split_by_group(rows, 0.2, seed=1)
    assert not {r["group"] for r in train} & {r["group"] for r in test}
    ev = evaluate(fit(train), test, len(train))
    assert ev.accuracy >= 0.9, ev.table()
    assert ev.public_accuracy >= 0.9
    assert min(ev.per_class_recall.values()) >= 0.8, ev.per_class_recall
    assert {r["label"] for r in test} == set(WORKLOAD_CLASSES)


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("Can you whip up a Go program that tails a log file and prints lines matching a regex?", "code"),
        ("My React component re-renders forever when I call setState in useEffect. How do I fix it?", "code"),
        ("```\nSELECT name, COUNT(*) FROM orders GROUP BY name\n```\nWhy is this query slow?", "code"),
        ("How do you say 'where is the train station' in Italian?", "translation"),
        ("Please translate into Korean: The meeting has been moved to Thursday afternoon.", "translation"),
        ("Put this sentence into French for me: I would like two coffees, please.", "translation"),
    ],
)
def test_unseen_phrasings_of_code_and_translation(shipped: WorkloadClassifier, text: str, label: str) -> None:
    got = shipped.classify(RequestInfo(text=text, last_user=text))
    assert got.label == label, got.probs


def test_tools_or_json_mode_is_a_tool_call_by_rule(shipped: WorkloadClassifier) -> None:
    text = "Write a poem about the sea."
    plain = shipped.classify(RequestInfo(text=text))
    assert plain.label == "open_chat"
    tools = shipped.classify(
        RequestInfo(text=text, tool_names=["get_weather"], tool_descriptions=["weather"])
    )
    json_mode = shipped.classify(RequestInfo(text=text, json_mode=True))
    assert (tools.label, tools.rule, tools.confidence) == ("tool_call", "tools", 1.0)
    assert (json_mode.label, json_mode.rule) == ("tool_call", "json_mode")


@pytest.mark.slow
def test_fast_path_reproduces_the_sklearn_pipeline(rows: list[dict]) -> None:
    from scipy import sparse
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    from specgate.policies.text_model import ANALYZERS

    sample = rows[::7]
    infos = [row_info(r) for r in sample]
    texts = [i.classifier_text() for i in infos]
    dense = [structural(i) for i in infos]
    labels = [r["label"] for r in sample]
    model = LinearTextModel.fit(texts, dense, labels, WORKLOAD_CLASSES, max_terms=5000)
    # The same pipeline, in sklearn end to end.
    vecs = [
        TfidfVectorizer(analyzer=fn, sublinear_tf=True, max_features=5000, min_df=2)
        for fn in ANALYZERS.values()
    ]
    names = sorted(dense[0])
    x = sparse.hstack(
        [v.fit_transform(texts) for v in vecs] + [sparse.csr_matrix([[d[n] for n in names] for d in dense])]
    ).tocsr()
    lr = LogisticRegression(C=10.0, max_iter=2000).fit(x, [WORKLOAD_CLASSES.index(y) for y in labels])
    expected = lr.predict_proba(x[:25])
    got = np.stack([model.predict_proba(t, d) for t, d in zip(texts[:25], dense[:25], strict=True)])
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_artifact_round_trip_and_metadata(tmp_path: Path, shipped: WorkloadClassifier) -> None:
    path = tmp_path / "clf.npz"
    shipped.model.save(path, {"version": "test-1"})
    back = WorkloadClassifier.load(path)
    assert back.version == "test-1"
    info = RequestInfo(text="Summarize: the council voted to close the library on Sundays.")
    np.testing.assert_allclose(back.text_probs(info), shipped.text_probs(info), atol=1e-6)
    assert shipped.version.startswith("wc-")
    assert shipped.metadata["heldout"]["accuracy"] >= 0.9


def test_classification_reads_a_bounded_slice_of_any_prompt(shipped: WorkloadClassifier) -> None:
    """What keeps classification cheap (about 0.2 ms, printed by `specgate policy train-classifier`):
    the text model's input does not grow with the prompt."""
    doc = "The quarterly report covers revenue, costs and the outlook for next year. " * 2000
    info = RequestInfo(text=doc + "\nQuestion: what was the revenue?", last_user="what was the revenue?")
    assert len(info.classifier_text()) <= HEAD_CHARS + TAIL_CHARS * 2 + 2
    assert shipped.classify(info).label in WORKLOAD_CLASSES


def test_missing_artifact_names_the_command(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="train-classifier"):
        WorkloadClassifier.load(tmp_path / "none.npz")


def test_score_cache_gives_the_uncached_answer_and_stays_bounded() -> None:
    clf = WorkloadClassifier.load()
    clf.cache = ScoreCache(2)
    a = RequestInfo(text="def f(x):\n    return x + 1\n\nAdd type hints.", last_user="Add type hints.")
    b = RequestInfo(text="Translate to French: good morning", last_user="Translate to French: good morning")
    # Same opening text, different structure: the dense features are never taken from the cache.
    a_q = RequestInfo(text=a.text, last_user="Add type hints?")
    expected = {id(r): clf.model.predict_proba(r.classifier_text(), structural(r)) for r in (a, b, a_q)}
    first = clf.text_probs(a)
    assert clf.cache.misses == 1 and clf.cache.hits == 0
    again = clf.text_probs(a)
    assert clf.cache.hits == 1 and np.array_equal(first, again)
    assert np.allclose(first, expected[id(a)], rtol=0, atol=1e-12)
    assert np.allclose(clf.text_probs(b), expected[id(b)], rtol=0, atol=1e-12)
    probs_q = clf.text_probs(a_q)
    assert np.allclose(probs_q, expected[id(a_q)], rtol=0, atol=1e-12)
    if a_q.classifier_text() == a.classifier_text():
        assert not np.array_equal(probs_q, first)  # ends_with_question differs
    clf.text_probs(RequestInfo(text="a third text", last_user="a third text"))
    assert len(clf.cache._entries) == 2  # the least recently used went
    cached = next(iter(clf.cache._entries.values()))
    with pytest.raises(ValueError):
        cached[0] = 1.0  # read-only: no request can change the scores another request reads


def test_a_repeated_request_gets_the_same_answer_and_its_own_copy() -> None:
    clf = WorkloadClassifier.load()
    info = RequestInfo(text="Summarize this article in three bullet points: ...", last_user="Summarize ...")
    first = clf.classify(info)
    first.probs["code"] = 99.0  # a caller scribbling on its answer
    second = clf.classify(info)
    assert clf.answers.hits == 1 and second.probs["code"] != 99.0
    fresh = WorkloadClassifier(clf.model).classify(info)
    assert (second.label, second.confidence, second.probs) == (fresh.label, fresh.confidence, fresh.probs)
