"""How `kvstage serve` counts tokens, and a tokenizer a benchmark client can load offline.

The rule: a token is a maximal run of non-whitespace characters (`str.split()`). The
server counts a prompt's tokens by it, and streams each output token as one word
(`OUTPUT_WORD`, with a leading space after the first), so text the server sends
re-tokenizes to the count it meant.

A client counts tokens with a Hugging Face tokenizer it loads by name or path; with no
hub to download from, `write_tokenizer(DIR)` writes one that follows the same rule: a
`tokenizer.json` (the `tokenizers` library's format: a word-level model behind a
whitespace-split pre-tokenizer, unknown words mapped to `[UNK]`, decoding joins tokens
with one space; `[UNK]` is an ordinary word, not a special token, so a client that
decodes with `skip_special_tokens` keeps it) and a `tokenizer_config.json` naming `PreTrainedTokenizerFast`, so
`AutoTokenizer.from_pretrained(DIR)` loads it without a network. Any text it encodes
gives as many ids as the rule counts words, and decoding any ids gives text the rule
counts back to the same number: the client's prompt lengths and output counts are the
server's.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["HUB_REPO", "OUTPUT_WORD", "count_tokens", "write_hub_cache", "write_tokenizer"]

OUTPUT_WORD = "kv"  # every output token's text
UNK = "[UNK]"
HUB_REPO = "kvstage/words"  # the tokenizer's name in a hub cache (`write_hub_cache`)
_REVISION = "0" * 40  # the snapshot's commit hash: the files never change
# the vocabulary: the unknown token, the output word and a few common English words (a
# client that builds prompts from a corpus gets some known ids; any word counts as one)
_WORDS = (
    "the of and to a in is that it for was on with as he be by at his you I this had not are "
    "but from or have an they which one were her all she there would their we him been has "
    "when who will more no if out so said what up its about into than them can only other"
).split()


def count_tokens(text: str) -> int:
    """Tokens of `text` by the rule (runs of non-whitespace characters)."""
    return len(text.split())


def write_tokenizer(directory: Path) -> Path:
    """Write the rule's tokenizer files into `directory` (created); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {UNK: 0, OUTPUT_WORD: 1}
    for word in _WORDS:
        vocab.setdefault(word, len(vocab))
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNK},
    }
    (directory / "tokenizer.json").write_text(json.dumps(spec, indent=1) + "\n")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return directory


def write_hub_cache(directory: Path) -> Path:
    """Lay the tokenizer out as a Hugging Face hub cache (`directory`, created) holding
    the repository `HUB_REPO` at revision `main`, and return `directory`: a client that
    only loads tokenizers by name in offline mode (AIPerf's worker processes set
    `HF_HUB_OFFLINE=1` and resolve every name through the cache) then loads it with
    `HF_HUB_CACHE=directory HF_HUB_OFFLINE=1` and the name `kvstage/words`."""
    repo = directory / ("models--" + HUB_REPO.replace("/", "--"))
    write_tokenizer(repo / "snapshots" / _REVISION)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(_REVISION)
    return directory
