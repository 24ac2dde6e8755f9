from freetoken.engine.detokenizer import IncrementalDetokenizer
from tests.engine.fakes import CharTokenizer


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def stream(detok, ids):
    pieces = [detok.push(i) for i in ids]
    if detok.matched_stop is None:
        pieces.append(detok.finish())
    return pieces


def test_text_concatenates_to_decode():
    tok = CharTokenizer()
    ids = tok.encode("hello big world")
    detok = IncrementalDetokenizer(tok, tok.encode("say "))
    assert "".join(stream(detok, ids)) == "hello big world"


def test_multibyte_characters_are_never_split():
    ids = list("héllo ☃ ok".encode())
    pieces = stream(IncrementalDetokenizer(ByteTokenizer(), [104]), ids)
    assert "".join(pieces) == "héllo ☃ ok"
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_is_cut_and_never_leaks():
    tok = CharTokenizer()
    detok = IncrementalDetokenizer(tok, [0], stop=["END", "zz"])
    pieces = stream(detok, tok.encode("abc ENDING more"))
    assert "".join(pieces) == "abc " and detok.matched_stop == "END"
    assert all("E" not in p for p in pieces)  # the partial "E", "EN" were held back


def test_partial_stop_prefix_released_when_ruled_out():
    tok = CharTokenizer()
    detok = IncrementalDetokenizer(tok, [0], stop=["STOP"])
    pieces = stream(detok, tok.encode("a STa STOx"))
    assert "".join(pieces) == "a STa STOx" and detok.matched_stop is None
    assert pieces[2] == pieces[3] == ""  # "S", "ST" waited: they might have begun "STOP"


def test_earliest_stop_wins_across_strings():
    tok = CharTokenizer()
    detok = IncrementalDetokenizer(tok, [0], stop=["cd", "b"])
    assert "".join(stream(detok, tok.encode("abcd"))) == "a" and detok.matched_stop == "b"
