"""``autoshard data prepare``: text files through a tokenizer saved offline (a word-level
``tokenizers`` model in ``PreTrainedTokenizerFast``), read back with autoshard.runtime.data."""

from pathlib import Path

import numpy as np
import pytest
import torch

from autoshard.cli import main as cli
from autoshard.runtime import data

WORDS = ["<unk>", "<eos>", "the", "cat", "sat", "on", "mat", "a", "dog"]


def _tokenizer(directory: Path, words: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(directory)
    return tok


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    return directory, _tokenizer(directory, WORDS)


@pytest.fixture
def texts(tmp_path) -> list[Path]:
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_text("the cat sat\non the mat\n")
    two.write_text("a dog sat on a cat\n\nthe end\n")  # "end": unknown word
    return [one, two]


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_prepare_one_document_per_file(tokenizer, texts, tmp_path, capsys):
    directory, tok = tokenizer
    out = tmp_path / "tokens.bin"
    assert cli(["data", "prepare", *map(str, texts), "--tokenizer", str(directory), "-o", str(out)]) == 0
    eos = tok.eos_token_id
    want = _encode(tok, texts[0].read_text()) + [eos] + _encode(tok, texts[1].read_text()) + [eos]
    f = data.open_file(out)
    assert (f.dtype, f.vocab) == (np.dtype("<u2"), len(WORDS))
    assert f.ids.tolist() == want
    assert 0 in want and want.count(eos) == 2  # the unknown word and one EOS after each document
    line = capsys.readouterr().out.strip()
    assert line == line.splitlines()[0]
    assert f"2 files, 2 documents, {len(want)} tokens, uint16, vocab {len(WORDS)}" in line
    # the model reads it: its whole windows, as training batches
    batch = data.global_batch(0, len(want) // 4, 4, len(WORDS), 0, out)
    assert sorted(batch.tolist()) == sorted(torch.tensor(want[: len(want) // 4 * 4]).view(-1, 4).tolist())


def test_prepare_split_lines_without_eos(tokenizer, texts, tmp_path, capsys):
    directory, tok = tokenizer
    out = tmp_path / "lines.bin"
    args = ["data", "prepare", *map(str, texts), "--tokenizer", str(directory), "-o", str(out)]
    assert cli([*args, "--split-lines", "--no-eos"]) == 0
    lines = [ln for t in texts for ln in t.read_text().splitlines() if ln.strip()]
    assert data.open_file(out).ids.tolist() == [i for ln in lines for i in _encode(tok, ln)]
    assert "2 files, 4 documents" in capsys.readouterr().out
    assert cli([*args, "--split-lines"]) == 0  # EOS by default: one after each line
    assert data.open_file(out).ids.tolist() == [i for ln in lines for i in [*_encode(tok, ln), tok.eos_token_id]]


def test_prepare_uint32_for_large_vocabularies(tmp_path, texts, capsys):
    words = WORDS + [f"w{i}" for i in range(70_000)]
    tok = _tokenizer(tmp_path / "big", words)
    texts[0].write_text("the w69999 cat w0")
    out = tmp_path / "big.bin"
    assert cli(["data", "prepare", str(texts[0]), "--tokenizer", str(tmp_path / "big"), "-o", str(out)]) == 0
    f = data.open_file(out)
    assert (f.dtype, f.vocab) == (np.dtype("<u4"), len(words))
    assert f.ids.tolist() == [*_encode(tok, "the w69999 cat w0"), tok.eos_token_id]
    assert max(f.ids.tolist()) == len(words) - 1


def test_prepare_errors(tokenizer, texts, tmp_path, capsys):
    directory, _ = tokenizer
    out = tmp_path / "tokens.bin"
    missing = tmp_path / "missing.txt"
    assert cli(["data", "prepare", str(texts[0]), str(missing), "--tokenizer", str(directory), "-o", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"autoshard: error: {missing}: no such text file"
    assert cli(["data", "prepare", str(texts[0]), "--tokenizer", str(tmp_path / "no-tokenizer"), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"autoshard: error: --tokenizer {tmp_path / 'no-tokenizer'}: cannot load the tokenizer")
    assert "\n" not in err
    texts[0].write_bytes(b"the \xff cat")
    assert cli(["data", "prepare", str(texts[0]), "--tokenizer", str(directory), "-o", str(out)]) == 2
    assert "not UTF-8 text" in capsys.readouterr().err
    assert not out.exists()
