"""The simulation's data (``omnidraft.simulations.data``): real labelled sources, the Dirichlet
non-IID split (disjoint, deterministic, skewed), JSONL data without labels split IID, and
codebase projects given out by popularity, with a newcomer from a project nobody else works in."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from omnidraft.simulations import data


def test_sources_are_real_text_with_labels():
    corpus = data.load_corpus(None)
    counts = Counter(corpus.labels)
    assert counts["humaneval"] == 164 and counts["stdlib"] > 1000 and counts["pydoc"] > 500
    i = corpus.labels.index("stdlib")
    assert (
        corpus.prompts[i].startswith(("def ", "async def "))
        and '"""' in corpus.prompts[i]
        or "'''" in corpus.prompts[i]
    )
    assert all(len(p) <= data.MAX_CHARS + 2 for p, lab in zip(corpus.prompts, corpus.labels) if lab == "pydoc")


def test_dirichlet_split_is_disjoint_deterministic_and_skewed():
    corpus = data.load_corpus("humaneval,pydoc")
    parts = data.split(corpus, 40, 5, alpha=0.1, seed=3)
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == 40 * 5 and {len(p) for p in parts} == {5}
    assert parts == data.split(corpus, 40, 5, alpha=0.1, seed=3)
    assert parts != data.split(corpus, 40, 5, alpha=0.1, seed=4)

    def majority(parts):  # mean share of each device's most common source
        return sum(Counter(corpus.labels[i] for i in p).most_common(1)[0][1] / len(p) for p in parts) / len(parts)

    assert majority(parts) > majority(data.split(corpus, 40, 5, alpha=100.0, seed=3)) + 0.1
    with pytest.raises(ValueError, match="need"):
        data.split(corpus, 400, 5, alpha=0.5, seed=0)


def test_jsonl_data_without_labels_is_split_iid(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"text number {i}"}) + "\n" for i in range(30)))
    corpus = data.load_corpus(str(path))
    parts = data.split(corpus, 6, 5, alpha=0.5, seed=0)
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == 30
    (tmp_path / "bad.jsonl").write_text('{"prompt": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        data.load_corpus(str(tmp_path / "bad.jsonl"))


def test_codebase_projects_split_by_popularity_with_unseen_newcomer():
    """One project per device, drawn by popularity; a contiguous stretch of its functions;
    newcomers from known projects, the last one from a project nobody else works in."""
    sizes = {"a": 100, "b": 60, "c": 30, "d": 20, "e": 10, "f": 10}
    labels = [f"codebase:{n}" for n, k in sizes.items() for _ in range(k)]
    corpus = data.Corpus([f"def f{i}(): pass" for i in range(len(labels))], labels)
    assert data.is_codebases(corpus) and not data.is_codebases(data.Corpus(["x"], ["humaneval"]))
    newcomers = frozenset(range(26, 30))
    parts, projects = data.split_projects(corpus, 30, 5, seed=1, newcomers=newcomers)
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == 150
    for part, project in zip(parts, projects):
        assert {labels[i] for i in part} == {project} and part == list(range(part[0], part[0] + 5))
    counts = Counter(projects[:26])
    assert counts["codebase:a"] > counts.get("codebase:d", 0) and len(counts) >= 3  # popular ones, and a tail
    known = set(projects[:26])
    assert all(projects[d] in known for d in (26, 27, 28))
    assert projects[29] not in known and projects.count(projects[29]) == 1  # a project the fleet never saw
    assert (parts, projects) == data.split_projects(corpus, 30, 5, seed=1, newcomers=newcomers)
    assert projects != data.split_projects(corpus, 30, 5, seed=2, newcomers=newcomers)[1]
    with pytest.raises(ValueError, match="too few.*--share-projects"):
        data.split_projects(corpus, 60, 5, seed=0)
    # more devices than disjoint stretches: teammates share a project's stretches, in turn
    parts, projects = data.split_projects(corpus, 60, 5, seed=0, newcomers=frozenset(range(56, 60)), share=True)
    assert len(parts) == 60 and len({tuple(p) for p in parts}) < 60  # some devices share a stretch
    for part, project in zip(parts, projects):
        assert {labels[i] for i in part} == {project} and part == list(range(part[0], part[0] + 5))
        assert (part[0] - labels.index(project)) % 5 == 0  # one of the project's own stretches
    assert projects[59] not in set(projects[:59])  # the unseen project stays unseen
    assert data.split_projects(corpus, 30, 5, seed=1, newcomers=newcomers, share=True) == data.split_projects(
        corpus, 30, 5, seed=1, newcomers=newcomers
    )  # room enough: sharing changes nothing


def test_codebase_sources_are_real_projects():
    corpus = data.load_corpus("codebase:click,codebase:peft")
    assert set(corpus.labels) == {"codebase:click", "codebase:peft"} and data.is_codebases(corpus)
    assert all(len([x for x in corpus.labels if x == lab]) <= data.PROJECT_PROMPTS for lab in set(corpus.labels))
    assert all("def " in p for p in corpus.prompts)
    with pytest.raises(ValueError, match="not installed"):
        data.load_corpus("codebase:no_such_package_here")


def test_a_method_prompt_carries_only_its_own_decorators():
    """A class whose first method is decorated: the class header stops before that method's
    decorators, so each method's prompt is code as written (no decorator twice, none borrowed)."""
    import ast

    from omnidraft.benchmarks.codebase_prompts import _function_heads

    source = (
        "class Key:\n"
        "    @classmethod\n"
        "    def generate(cls):\n" + "        x = 1\n" * 4 + "    def sign(self, data):\n" + "        y = 2\n" * 4
    )
    heads = [head for _, head in _function_heads(ast.parse(source), source.splitlines())]
    assert heads == [
        "class Key:\n    @classmethod\n    def generate(cls):\n",
        "class Key:\n    def sign(self, data):\n",
    ]
    assert all(head in source or head.replace("class Key:\n", "") in source for head in heads)
