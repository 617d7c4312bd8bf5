"""The training program's token data (autoshard.runtime.data): the file formats, directory
streams, the sample order (independent of how rows are split among data-parallel ranks and of
the batch size), epochs, the synthetic stream, and the one-line errors."""

import json

import numpy as np
import pytest
import torch

from autoshard.errors import ProgramError
from autoshard.runtime import data
from autoshard.runtime import program as rt

SEQ = 4


def _ids(count: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, count)


def _windows(ids: np.ndarray, seq: int = SEQ) -> set[tuple[int, ...]]:
    n = len(ids) // seq
    return {tuple(ids[i * seq : (i + 1) * seq].tolist()) for i in range(n)}


def _rows(batch: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(r) for r in batch.tolist()]


def test_header_round_trip_uint16(tmp_path):
    ids = _ids(40, 1000)
    path = tmp_path / "tokens.bin"
    assert data.write_tokens(path, ids, 1000) == "uint16"
    f = data.open_file(path)
    assert (f.dtype, f.count, f.vocab, f.offset) == (np.dtype("<u2"), 40, 1000, data.HEADER.size)
    assert path.stat().st_size == data.HEADER.size + 2 * 40
    assert np.array_equal(f.ids, ids)
    assert not list(tmp_path.glob(".*"))  # the temporary file was renamed over the target
    # one epoch of batches of every window: each window once, as the file holds it
    batch = data.global_batch(0, 10, SEQ, 1000, seed=3, data=path)
    assert batch.dtype == torch.long and batch.shape == (10, SEQ)
    assert sorted(_rows(batch)) == sorted(_windows(ids))


def test_header_uint32_for_large_vocabularies(tmp_path):
    ids = np.array([0, 65535, 65536, 99_999, 7, 8, 9, 10])
    path = tmp_path / "big.bin"
    assert data.write_tokens(path, ids, 100_000) == "uint32"
    assert data.open_file(path).dtype == np.dtype("<u4")
    batch = data.global_batch(0, 2, SEQ, 100_000, seed=0, data=path)
    assert sorted(_rows(batch)) == sorted(_windows(ids))


def test_write_tokens_refuses_ids_outside_the_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="outside"):
        data.write_tokens(tmp_path / "t.bin", np.array([1, 2, 50]), 50)
    assert not list(tmp_path.iterdir())


def test_sidecar_and_legacy_files_read_as_the_header_format(tmp_path):
    ids = _ids(48, 60_000, seed=1)
    data.write_tokens(tmp_path / "header.bin", ids, 60_000)
    ids.astype("<u2").tofile(tmp_path / "nanogpt.bin")
    (tmp_path / "nanogpt.bin.json").write_text(json.dumps({"dtype": "uint16"}))
    ids.astype("<i4").tofile(tmp_path / "legacy.bin")
    assert data.open_file(tmp_path / "legacy.bin").legacy
    for index in range(3):
        want = data.global_batch(index, 5, SEQ, 60_000, seed=2, data=tmp_path / "header.bin")
        for name in ("nanogpt.bin", "legacy.bin"):
            assert torch.equal(data.global_batch(index, 5, SEQ, 60_000, seed=2, data=tmp_path / name), want)


def test_a_directory_is_one_stream_in_name_order(tmp_path):
    ids = _ids(50, 500, seed=4)
    data.write_tokens(tmp_path / "whole.bin", ids, 500)
    shards = tmp_path / "shards"
    shards.mkdir()
    # cuts that are not multiples of SEQ: windows straddle the files
    data.write_tokens(shards / "a.bin", ids[:7], 500)
    ids[7:19].astype("<u4").tofile(shards / "b.bin")
    (shards / "b.bin.json").write_text('{"dtype": "uint32"}')
    (shards / "c.bin").write_bytes(b"")  # an empty file adds nothing
    ids[19:].astype("<i4").tofile(shards / "d.bin")
    (shards / ".d.bin.123.tmp").write_bytes(b"\xff" * 8)  # hidden: skipped
    stream = data.stream(shards)
    assert [f.path.name for f in stream.files] == ["a.bin", "b.bin", "d.bin"]
    assert stream.tokens == 50
    for index in range(4):
        want = data.global_batch(index, 3, SEQ, 500, seed=5, data=tmp_path / "whole.bin")
        assert torch.equal(data.global_batch(index, 3, SEQ, 500, seed=5, data=shards), want)


@pytest.mark.parametrize("source", ["file", "synthetic"])
def test_rows_of_any_data_parallel_split_are_the_global_batch(tmp_path, source):
    path = None
    if source == "file":
        path = tmp_path / "t.bin"
        data.write_tokens(path, _ids(400, 300, seed=6), 300)
    batch = 8
    for index in (0, 1, 13):  # 13: past the first epoch of 100 windows
        whole = data.global_batch(index, batch, SEQ, 300, seed=7, data=path)
        for dp in (1, 2, 4, 8):
            rows = batch // dp
            parts = [data.batch_rows(index, batch, SEQ, 300, 7, path, r * rows, (r + 1) * rows) for r in range(dp)]
            assert torch.equal(torch.cat(parts), whole)
        assert torch.equal(data.batch_rows(index, batch, SEQ, 300, 7, path, 3, 6), whole[3:6])


def test_samples_do_not_depend_on_the_batch_size(tmp_path):
    path = tmp_path / "t.bin"
    data.write_tokens(path, _ids(200, 300, seed=8), 300)
    eight = torch.cat([data.global_batch(i, 8, SEQ, 300, 9, path) for i in range(4)])
    two = torch.cat([data.global_batch(i, 2, SEQ, 300, 9, path) for i in range(16)])
    assert torch.equal(eight, two)


def test_order_is_a_function_of_seed_and_index(tmp_path):
    path = tmp_path / "t.bin"
    data.write_tokens(path, _ids(4000, 300, seed=10), 300)
    first = data.global_batch(2, 6, SEQ, 300, 11, path)
    data._STREAMS.clear()  # a restart: the files are opened afresh
    assert torch.equal(data.global_batch(2, 6, SEQ, 300, 11, path), first)
    assert not torch.equal(data.global_batch(2, 6, SEQ, 300, 12, path), first)
    assert not torch.equal(data.global_batch(3, 6, SEQ, 300, 11, path), first)


@pytest.mark.parametrize("windows", [1, 2, 7, 12, 64, 97])
def test_each_epoch_is_a_permutation_of_the_windows(windows):
    orders = []
    for epoch in range(4):
        order = [data.window(epoch * windows + i, windows, seed=1) for i in range(windows)]
        assert sorted(order) == list(range(windows))
        orders.append(order)
    if windows >= 12:
        assert len({tuple(o) for o in orders}) > 1  # epochs are shuffled differently


def test_epochs_wrap_around_the_stream(tmp_path):
    ids = _ids(22, 300, seed=13)  # 5 windows of 4, 2 tokens left out
    path = tmp_path / "t.bin"
    data.write_tokens(path, ids, 300)
    epochs = [data.global_batch(e, 5, SEQ, 300, 14, path) for e in range(6)]
    for batch in epochs:
        assert sorted(_rows(batch)) == sorted(_windows(ids))
    crossing = data.global_batch(1, 3, SEQ, 300, 14, path)  # samples 3, 4 (epoch 0) and 5 (epoch 1)
    assert torch.equal(crossing, torch.cat([epochs[0][3:5], epochs[1][:1]]))


def test_synthetic_stream_is_unchanged():
    gen = torch.Generator().manual_seed(7 * 1_000_003 + 3)
    want = torch.randint(0, 50, (4, 8), generator=gen)
    assert torch.equal(data.global_batch(3, 4, 8, 50, 7), want)
    assert torch.equal(rt.global_batch(3, 4, 8, 50, 7), want)


def test_program_global_batch_reads_the_same_data(tmp_path):
    path = tmp_path / "t.bin"
    data.write_tokens(path, _ids(100, 300, seed=15), 300)
    assert torch.equal(rt.global_batch(4, 4, SEQ, 300, 1, path), data.global_batch(4, 4, SEQ, 300, 1, path))


def test_a_rewritten_file_is_reopened(tmp_path):
    path = tmp_path / "t.bin"
    data.write_tokens(path, np.full(8, 3), 300)
    assert data.global_batch(0, 2, SEQ, 300, 0, path).unique().tolist() == [3]
    data.write_tokens(path, np.full(12, 5), 300)
    assert data.global_batch(0, 3, SEQ, 300, 0, path).unique().tolist() == [5]


def _error(capsys, call) -> str:
    with pytest.raises(ProgramError) as e:
        call()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("train.py: error: ") and "\n" not in err
    return err


def test_errors(tmp_path, capsys):
    def batch(path, vocab=300, seq=SEQ):
        return lambda: data.global_batch(0, 2, seq, vocab, 0, path)

    assert "no such file or directory" in _error(capsys, batch(tmp_path / "missing.bin"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.json").write_text("{}")
    assert "holds no token files" in _error(capsys, batch(tmp_path / "empty"))

    good = tmp_path / "good.bin"
    data.write_tokens(good, _ids(10, 300), 300)
    raw = good.read_bytes()
    (tmp_path / "v9.bin").write_bytes(raw[:8] + (9).to_bytes(4, "little") + raw[12:])
    assert "bad header (version 9" in _error(capsys, batch(tmp_path / "v9.bin"))
    (tmp_path / "cut.bin").write_bytes(raw[:-2])
    assert "truncated" in _error(capsys, batch(tmp_path / "cut.bin"))
    (tmp_path / "stub.bin").write_bytes(raw[:20])
    assert "bad header" in _error(capsys, batch(tmp_path / "stub.bin"))

    assert "fewer than one sequence of 16" in _error(capsys, batch(good, seq=16))
    assert "vocabulary of 300 ids but the model has 100" in _error(capsys, batch(good, vocab=100))

    legacy = tmp_path / "legacy.bin"
    np.array([1, 2, 3, 70_000, 5, 6, 7, 8], dtype="<i4").tofile(legacy)
    err = _error(capsys, batch(legacy, vocab=1000))
    assert f"--data {legacy}: token id 70000" in err and "data prepare --tokenizer" in err and "legacy.bin.json" in err
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00" * 5)
    assert 'odd.bin.json ({"dtype": "uint16"}' in _error(capsys, batch(tmp_path / "odd.bin"))

    (tmp_path / "side.bin").write_bytes(b"\x01\x00" * 8)
    (tmp_path / "side.bin.json").write_text('{"dtype": "float32"}')
    assert "got 'float32'" in _error(capsys, batch(tmp_path / "side.bin"))
    (tmp_path / "both.bin").write_bytes(raw)
    (tmp_path / "both.bin.json").write_text('{"dtype": "uint16"}')
    assert "delete the sidecar" in _error(capsys, batch(tmp_path / "both.bin"))


def test_only_the_rows_read_are_checked(tmp_path, capsys):
    """ids beyond the vocabulary fail the step whose rows hold them, naming the file in a directory."""
    shards = tmp_path / "shards"
    shards.mkdir()
    data.write_tokens(shards / "a.bin", np.zeros(4000, dtype=np.int64), 0)
    data.write_tokens(shards / "b.bin", np.full(4, 9), 0)  # one window, past the model's vocabulary of 5
    failing = []
    for index in range(1001):
        try:
            data.global_batch(index, 1, SEQ, 5, 0, shards)
        except ProgramError:
            failing.append(index)
            assert f"--data {shards / 'b.bin'}: token id 9" in capsys.readouterr().err
    assert len(failing) == 1  # one epoch of 1001 windows reads b.bin's window once
