"""The detokenizer's byte table (pipeline/detokenizer.py, byte_pieces): for a byte-level tokenizer
each token's bytes, joined and read as UTF-8 incrementally, give the text the tokenizers library's
DecodeStream gives, step for step, and what tokenizer.decode gives for the whole sequence (also
where the bytes are not valid UTF-8); special
tokens and ids past the tokenizer's vocabulary decode to nothing; tokenizers whose decoder is not
ByteLevel alone keep DecodeStream."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models

from tandem.pipeline.detokenizer import IncrementalDetokenizer, byte_pieces

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tandem-tiny-code" / "tokenizer.json"
TEXT = "héllo wörld ∑ 🙂 naïve café 日本語 \n\tdef f(x):\n    return {x: 'ü'}"


def _steps(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    """The text each step releases, ids fed in chunks of the given sizes."""
    out, at = [], 0
    for size in chunks:
        detok.add(ids[at : at + size])
        out.append(detok.take(final=False))
        at += size
    return out


@pytest.fixture(params=["shipped", "tiny"])
def tokenizer(request, tiny_root):
    path = SHIPPED if request.param == "shipped" else tiny_root / "qwen3_5_mtp1" / "tokenizer.json"
    return Tokenizer.from_file(str(path))


def test_byte_table_gives_decode_stream_text_step_for_step(tokenizer):
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    pieces = byte_pieces(tokenizer, vocab + 40)
    assert pieces is not None and len(pieces) == vocab + 40
    rng = np.random.default_rng(0)
    valid = tokenizer.encode(TEXT).ids
    special = [i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special]
    sequences = [valid,                                                  # characters split across tokens
                 [int(t) for t in rng.integers(0, vocab, 300)],          # any bytes, invalid UTF-8 too
                 valid[:7] + special + valid[7:] + [vocab + 3, vocab + 39] + valid[:5]]   # special, past the vocab
    for ids in sequences:
        for chunks in ([1] * len(ids), [int(c) for c in rng.integers(1, 9, len(ids))]):
            stream = _steps(IncrementalDetokenizer(tokenizer), ids, chunks)
            table = _steps(IncrementalDetokenizer(tokenizer, pieces=pieces), ids, chunks)
            if ids is sequences[1]:
                # invalid bytes: the table's text is tokenizer.decode's (each invalid byte U+FFFD as soon as
                # it is known), but for an unfinished character's bytes at the end, which it holds back;
                # DecodeStream, restarted after 4 undecodable tokens, may differ from both there
                whole = tokenizer.decode(ids)
                assert whole.startswith("".join(table)) and set(whole[len("".join(table)) :]) <= {"\ufffd"}
            else:
                assert table == stream
    whole = IncrementalDetokenizer(tokenizer, pieces=pieces)
    whole.add(valid)
    assert whole.text == tokenizer.decode(valid)


def test_a_character_split_across_steps_is_held_back(tokenizer):
    pieces = byte_pieces(tokenizer)
    ids = tokenizer.encode("🙂🙂 日本").ids
    detok = IncrementalDetokenizer(tokenizer, pieces=pieces)
    released = _steps(detok, ids, [1] * len(ids))
    assert "".join(released) == tokenizer.decode(ids)
    assert not any("\ufffd" in r for r in released)


def test_added_tokens_outside_the_byte_alphabet_decode_as_their_text(tokenizer):
    """An added, non-special token with a space in it is not byte-level text: the ByteLevel decoder
    takes its UTF-8 as it is, and so does the table."""
    tokenizer.add_tokens(["naïve tok", "<tool>"])
    pieces = byte_pieces(tokenizer)
    assert pieces is not None
    ids = [tokenizer.token_to_id("naïve tok"), *tokenizer.encode(" x").ids, tokenizer.token_to_id("<tool>")]
    detok = IncrementalDetokenizer(tokenizer, pieces=pieces)
    detok.add(ids)
    assert detok.text == tokenizer.decode(ids)


def test_other_decoders_keep_the_decode_stream():
    tok = Tokenizer(models.WordLevel({"▁a": 0, "▁b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.Metaspace()
    assert byte_pieces(tok) is None


def test_special_tokens_kept_when_asked(tokenizer):
    """skip_special_tokens=False: the table with special tokens and DecodeStream give
    tokenizer.decode(ids, skip_special_tokens=False), step for step; the default leaves them out."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    special = [i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special]
    assert special
    valid = tokenizer.encode(TEXT).ids
    ids = valid[:5] + special + special[:1] + valid[5:]
    table = byte_pieces(tokenizer, vocab, skip_special_tokens=False)
    assert table is not None
    kept = [_steps(IncrementalDetokenizer(tokenizer, pieces=table, skip_special_tokens=False), ids, [1] * len(ids)),
            _steps(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), ids, [1] * len(ids))]
    assert kept[0] == kept[1] and "".join(kept[0]) == tokenizer.decode(ids, skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tokenizer, pieces=byte_pieces(tokenizer, vocab))
    skipped.add(ids)
    assert skipped.text == tokenizer.decode(ids) != "".join(kept[0])


def test_no_space_between_adjacent_added_tokens_when_asked():
    """A WordPiece decoder puts a space between tokens, added ones too; with spaces_between_special_tokens
    false two added tokens in a row are written as they are (vLLM's rule for fast tokenizers)."""
    tok = Tokenizer(models.WordPiece({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["<s>", "</s>"])
    ids = [0, tok.token_to_id("<s>"), tok.token_to_id("</s>"), 1]

    def text(spaces: bool) -> str:
        detok = IncrementalDetokenizer(tok, skip_special_tokens=False, spaces_between_special_tokens=spaces)
        detok.add(ids)
        return detok.text

    assert text(True) == tok.decode(ids, skip_special_tokens=False)
    assert "<s></s>" in text(False) and text(False) != text(True)
