"""GGUF SentencePiece ("llama") vocabularies: ids and text as llama.cpp makes them (a space before
every run of text, also after special tokens and before text that starts with a space), checked
against a plain SentencePiece merge loop, against transformers where its rules agree, and against
llama.cpp itself when llama-cpp-python is installed."""

from __future__ import annotations

import re

import pytest

from freetoken.models.errors import ModelFormatError, UnsupportedModelError
from freetoken.models.checkpoint.gguf_file import GGUFFile
from freetoken.models.tokenizer.gguf import tokenizer_from_gguf

UNKNOWN, CONTROL, USER_DEFINED, BYTE, NORMAL = 2, 3, 4, 6, 1
SPACE = "\u2581"
SPECIALS = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
END_OF_TURN, USER_PIECE = "<|im_end|>", "<tool>"

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Héllo wörld, naïve café, résumé, façade, Ångström, El Niño.",
    "日本語のテキストと中文文本，还有更多的中文字符。東京は大きい都市です。",
    "emoji 🙂🚀 and 👍🏽 thumbs, 🙂 again and again 🚀🚀",
    "digits 12345 678 90 and 3.14159, 2024-01-31, 1,000,000",
    "line one\nline two\n\nline  four\n\tindented with a tab",
    "  leading spaces and   triple spaces,    four spaces",
    "def main():\n    return 42  # code with spaces\n",
    "The the THE there their they're them themselves theme thematic.",
]
TEXTS = CORPUS + [
    "", " ", "  ", "\n", "Hello", " Hello", "  Hello  ", "hello\n\nworld\n",
    "Straße Ω ω 한국어 🎉 ∑ — unseen characters fall back to bytes",
    "mixed 12ab日本🙂 text", "zzzz qqqq xxxx", "the theme thereof",
]
SPECIAL_TEXTS = ["<s>inline special</s>", f"reply{END_OF_TURN}", "<unk> marker",
                 f"a {USER_PIECE} b", f"{END_OF_TURN}{END_OF_TURN}x"]
CHAT_PROMPTS = [
    "<s>[INST] <<SYS>>\nYou are a helpful assistant.\n<</SYS>>\n\nHello there [/INST] Hi! How "
    "can I help?</s><s>[INST] Tell me a joke [/INST]",
    "<s>[INST] hi [/INST]", "<s> leading space after bos", "</s> \n <s>  two spaces",
    f"{END_OF_TURN}\nuser\nHello{END_OF_TURN}\nassistant\n",
    f"a {USER_PIECE} b{USER_PIECE}c {USER_PIECE}", f"{USER_PIECE}  two",
]
WHOLE_PIECES = re.compile("|".join(re.escape(t) for t in SPECIALS + [END_OF_TURN, USER_PIECE]))


def text_runs(text: str) -> list[str]:
    """The runs of plain text between pieces matched whole (special and user-defined)."""
    return WHOLE_PIECES.split(text)


def rules_agree(text: str) -> bool:
    """Whether transformers' GGUF loader tokenizes `text` like llama.cpp: it puts the space only
    before the first run of text, and not when that run already starts with a space."""
    first, *rest = text_runs(text)
    return not first.startswith(" ") and not any(rest)


AGREED_TEXTS = [t for t in TEXTS + SPECIAL_TEXTS if rules_agree(t)]


def spm_vocabulary():
    """Pieces laid out as a SentencePiece llama vocabulary: unk, bos, eos, 256 byte pieces, the
    trained pieces (score = minus the id, so earlier merges score higher), then two extras."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=SPECIALS + BYTES,
                                  show_progress=False)
    trained.train_from_iterator(CORPUS * 3, trainer)
    vocab = trained.get_vocab()
    tokens = sorted(vocab, key=vocab.get) + [END_OF_TURN, USER_PIECE]
    types = ([UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
             + [NORMAL] * (len(tokens) - 261) + [CONTROL, USER_DEFINED])
    scores = [-float(i) if kind == NORMAL else 0.0 for i, kind in enumerate(types)]
    return tokens, scores, types


def write_spm_gguf(path, tokens, scores, types, arch="llama", **flags):
    """A tensor-less GGUF holding only a SentencePiece tokenizer (and the few hyper-parameters
    llama.cpp reads to open it). `flags`: add_bos, add_eos, add_space_prefix (None leaves the
    key out); scores=None leaves tokenizer.ggml.scores out."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if flags.get("add_bos") is not None:
        writer.add_add_bos_token(flags["add_bos"])
    if flags.get("add_eos") is not None:
        writer.add_add_eos_token(flags["add_eos"])
    if flags.get("add_space_prefix") is not None:
        writer.add_add_space_prefix(flags["add_space_prefix"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def vocabulary():
    return spm_vocabulary()


def shuffled_scores(scores, types, tied):
    """Scores no longer in id order, so the merge order rests on the scores alone; `tied` pieces
    in a row share a score, so it also rests on the tie rule."""
    import random

    normal = [i for i, kind in enumerate(types) if kind == NORMAL]
    order = random.Random(7).sample(normal, len(normal))
    shuffled = list(scores)
    for rank, index in enumerate(order):
        shuffled[index] = -float(rank // tied)
    return shuffled


@pytest.fixture(scope="module")
def gguf_file(vocabulary, tmp_path_factory):
    """The path of one test GGUF per setting (add_bos, add_eos, add_space_prefix, shuffled:
    0 keeps the scores in id order, n shuffles them with n pieces per score), written once."""
    written = {}

    def make(add_bos=None, add_eos=None, add_space_prefix=None, shuffled=0):
        key = (add_bos, add_eos, add_space_prefix, shuffled)
        if key not in written:
            tokens, scores, types = vocabulary
            if shuffled:
                scores = shuffled_scores(scores, types, shuffled)
            folder = tmp_path_factory.mktemp("spm")
            written[key] = write_spm_gguf(folder / "spm.gguf", tokens, scores, types,
                                          add_bos=add_bos, add_eos=add_eos,
                                          add_space_prefix=add_space_prefix)
        return written[key]

    return make


@pytest.fixture(scope="module")
def ours(gguf_file):
    """Our tokenizer for a setting of `gguf_file`."""
    def make(**setting):
        path = gguf_file(**setting)
        return tokenizer_from_gguf(GGUFFile(path).meta, str(path))

    return make


@pytest.fixture(scope="module")
def pair(gguf_file, ours):
    """(ours, transformers) for one GGUF per setting, built once each."""
    from transformers import AutoTokenizer

    built = {}

    def make(add_bos=None, add_eos=None, shuffled=0):
        key = (add_bos, add_eos, shuffled)
        if key not in built:
            path = gguf_file(add_bos=add_bos, add_eos=add_eos, shuffled=shuffled)
            reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            built[key] = ours(add_bos=add_bos, add_eos=add_eos, shuffled=shuffled), reference
        return built[key]

    return make


def sentencepiece_pieces(text: str, vocabulary) -> list[str]:
    """Pieces of one run of text (spaces already spelled "▁") by SentencePiece's BPE loop:
    join the adjacent pair whose joined piece scores highest (leftmost on ties) until no pair
    joins; a symbol that is not a piece is spelled by its UTF-8 bytes."""
    tokens, scores, types = vocabulary
    score = {t: s for t, s, kind in zip(tokens, scores, types) if kind == NORMAL}
    symbols = list(text)
    while True:
        joins = [(score[a + b], -i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))
                 if a + b in score]
        if not joins:
            break
        i = -max(joins)[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    known = set(tokens)
    pieces = []
    for symbol in symbols:
        pieces += [symbol] if symbol in known else [f"<0x{b:02X}>" for b in symbol.encode()]
    return pieces


def expected_pieces(text: str, vocabulary, prefix: bool = True) -> list[str]:
    """llama.cpp's pieces for `text`: each run between whole-matched pieces gets a "▁" before
    it (when the file asks for the prefix) and its spaces spelled "▁"."""
    pieces = []
    for index, run in enumerate(text_runs(text)):
        if index:
            pieces.append(WHOLE_PIECES.findall(text)[index - 1])
        if run:
            pieces += sentencepiece_pieces((SPACE if prefix else "") + run.replace(" ", SPACE),
                                           vocabulary)
    return pieces


def pieces_of(tok, ids) -> list[str]:
    return [tok.backend.id_to_token(i) for i in ids]


def test_vocabulary_exercises_byte_fallback(ours):
    tok = ours()
    ids = tok.encode("Straße 🎉")
    assert any(tok.backend.id_to_token(i).startswith("<0x") for i in ids)
    assert tok.backend.get_vocab_size() > 600


@pytest.mark.parametrize("text", TEXTS + SPECIAL_TEXTS + CHAT_PROMPTS)
def test_pieces_follow_sentencepiece_with_llama_cpp_spaces(ours, vocabulary, text):
    assert pieces_of(ours(), ours().encode(text)) == expected_pieces(text, vocabulary)


@pytest.mark.parametrize("text", TEXTS + SPECIAL_TEXTS + CHAT_PROMPTS)
def test_no_space_prefix_when_the_file_says_so(ours, vocabulary, text):
    tok = ours(add_space_prefix=False)
    assert pieces_of(tok, tok.encode(text)) == expected_pieces(text, vocabulary, prefix=False)


def test_prefix_follows_every_special_token(ours):
    tok = ours()
    assert tok.token_id("[INST]") is None      # plain text here, so it gets the prefix
    bos = tok.token_id("<s>")
    assert tok.encode("<s>[INST] hi [/INST]") == [bos] + tok.encode("[INST] hi [/INST]")
    assert tok.encode("[INST] hi [/INST]")[0] == tok.token_id(SPACE)     # "▁[" is no piece
    for whole in ("</s>", END_OF_TURN, USER_PIECE):
        assert tok.encode(f"Hello{whole}Hello") == (
            tok.encode("Hello") + [tok.token_id(whole)] + tok.encode("Hello"))


def test_leading_space_gets_its_own_prefix(ours):
    tok = ours()
    hello = tok.encode("Hello")
    assert pieces_of(tok, hello) == [f"{SPACE}Hello"]
    assert tok.token_id(SPACE * 2) is None     # so " Hello" is "▁" then "▁Hello"
    assert tok.encode(" Hello") == [tok.token_id(SPACE)] + hello
    assert tok.encode("  Hello") == [tok.token_id(SPACE)] * 2 + hello
    assert tok.decode(tok.encode(" Hello")) == " Hello"


@pytest.mark.parametrize("shuffled", [0, 3])
@pytest.mark.parametrize("text", AGREED_TEXTS)
def test_ids_match_transformers(pair, text, shuffled):
    ours_tok, reference = pair(shuffled=shuffled)
    assert ours_tok.encode(text) == reference.encode(text, add_special_tokens=False)
    assert ours_tok.encode(text, add_special_tokens=True) == reference.encode(text)


def decoded(text: str, skip_special_tokens: bool, prefix: bool = True) -> str:
    """What decoding the ids of `text` gives: every run of text keeps the space put before it,
    but for one space dropped at the very start; skipped specials leave nothing."""
    space = " " if prefix else ""
    runs, wholes = text_runs(text), WHOLE_PIECES.findall(text)
    shown = [("" if skip_special_tokens and w != USER_PIECE else w) for w in wholes]
    out = "".join(w + (space + run if run else "") for w, run in zip([""] + shown, runs))
    return out[1:] if prefix and out.startswith(" ") else out


@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("text", TEXTS + SPECIAL_TEXTS + CHAT_PROMPTS)
def test_decode_round_trips(ours, text, prefix):
    """Plain text comes back exactly (" Hello" too); text after a special token comes back
    behind the space llama.cpp puts there."""
    tok = ours() if prefix else ours(add_space_prefix=False)
    ids, framed = tok.encode(text), tok.encode(text, add_special_tokens=True)
    for skip in (True, False):
        assert tok.decode(ids, skip) == decoded(text, skip, prefix)
        assert tok.decode(framed, skip) == decoded("<s>" + text, skip, prefix)
    if not WHOLE_PIECES.search(text):
        assert tok.decode(ids) == text


@pytest.mark.parametrize("text", AGREED_TEXTS)
def test_decode_matches_transformers(pair, text):
    ours_tok, reference = pair()
    for ids in (ours_tok.encode(text), ours_tok.encode(text, add_special_tokens=True)):
        for skip in (True, False):
            assert ours_tok.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip)


STREAMED = ["Héllo  日本語 🙂🎉 Straße\n\nline  two ", " leading space", "  two leading",
            f"a {USER_PIECE} b{END_OF_TURN} after", f"{END_OF_TURN} x"] + CHAT_PROMPTS[:2]


@pytest.mark.parametrize("text", STREAMED)
def test_streaming_decode_equals_whole_decode(ours, text):
    tok = ours()
    ids = tok.encode(text)
    for skip in (True, False):
        stream = tok.incremental_decoder(skip)
        pieces = [stream.push(i) for i in ids]
        assert "".join(pieces) + stream.flush() == tok.decode(ids, skip)


@pytest.mark.parametrize("text", STREAMED)
def test_engine_detokenizer_keeps_the_reply_spaces(ours, text):
    """A reply streamed after a prompt keeps its first space: the prompt's tail is decoded
    with it, so only the prompt loses the prefix space."""
    from freetoken.engine.detokenizer import IncrementalDetokenizer

    tok = ours()
    prompt, reply = tok.encode("Question: hi", add_special_tokens=True), tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt)
    streamed = "".join(detok.push(i) for i in reply) + detok.finish()
    whole, head = tok.decode(prompt + reply), tok.decode(prompt)
    assert whole.startswith(head) and streamed == whole[len(head):]
    assert streamed.startswith(" ")     # every reply run begins with its "▁"


def test_special_tokens_match_transformers(pair):
    ours_tok, reference = pair()
    for name in ("bos_token", "eos_token", "unk_token"):
        assert ours_tok.special_tokens[name] == getattr(reference, name)
    assert ours_tok.bos_token_id == reference.bos_token_id == 1
    assert reference.eos_token_id in ours_tok.eos_token_ids
    assert ours_tok.token_id(END_OF_TURN) in ours_tok.eos_token_ids   # control end-of-turn
    assert ours_tok.vocab_size == len(reference)


@pytest.mark.parametrize("add_bos,add_eos", [(None, None), (True, False), (False, False),
                                              (False, True), (True, True)])
def test_bos_eos_flags_match_transformers(pair, add_bos, add_eos):
    ours_tok, reference = pair(add_bos, add_eos)
    ids = ours_tok.encode("Hello world", add_special_tokens=True)
    assert ids == reference.encode("Hello world")
    assert (ids[0] == 1) == (add_bos is not False)     # llama files add BOS unless told not to
    assert (ids[-1] == 2) == bool(add_eos)


# No tied scores here: among different pieces of one score SentencePiece joins the leftmost
# pair, which a ranked merge list cannot express (real vocabularies have distinct scores).
LLAMA_SETTINGS = {"default": {}, "no-prefix": {"add_space_prefix": False},
                  "shuffled": {"shuffled": 1}, "bos-off-eos-on": {"add_bos": False,
                                                                  "add_eos": True}}


@pytest.fixture(scope="module")
def llama_cpp_pair(gguf_file, ours):
    """(ours, llama.cpp) over the same GGUF, for a setting of LLAMA_SETTINGS."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed: no llama.cpp reference")
    built = {}

    def make(name):
        if name not in built:
            path = gguf_file(**LLAMA_SETTINGS[name])
            llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
            built[name] = ours(**LLAMA_SETTINGS[name]), llm
        return built[name]

    return make


@pytest.mark.parametrize("setting", LLAMA_SETTINGS)
@pytest.mark.parametrize("text", TEXTS + SPECIAL_TEXTS + CHAT_PROMPTS)
def test_ids_match_llama_cpp(llama_cpp_pair, setting, text):
    tok, llm = llama_cpp_pair(setting)
    assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True)
    assert (tok.encode(text, add_special_tokens=True)
            == llm.tokenize(text.encode(), add_bos=True, special=True))


def llama_cpp_detokenize(llm, ids: list[int], unparse_special: bool) -> str:
    """llama.cpp's own detokenizer (llama_detokenize): it drops one leading space of the first
    token when the file asks for the space prefix."""
    import ctypes

    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    array = (llama_cpp.llama_token * len(ids))(*ids)
    size = 64
    while True:   # a negative count is the size it needs
        buffer = ctypes.create_string_buffer(size)
        count = llama_cpp.llama_detokenize(vocab, array, len(ids), buffer, size, False,
                                           unparse_special)
        if 0 <= count <= size:
            return buffer.raw[:count].decode()
        assert -count > size
        size = -count


@pytest.mark.parametrize("setting", LLAMA_SETTINGS)
@pytest.mark.parametrize("text", TEXTS + SPECIAL_TEXTS + CHAT_PROMPTS)
def test_decode_matches_llama_cpp(llama_cpp_pair, setting, text):
    tok, llm = llama_cpp_pair(setting)
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == llama_cpp_detokenize(llm, ids, True)
    if not WHOLE_PIECES.match(text):   # llama.cpp spends the strip on a leading hidden special
        assert tok.decode(ids) == llama_cpp_detokenize(llm, ids, False)


@pytest.mark.parametrize("setting", ["default", "shuffled"])
@pytest.mark.parametrize("text", TEXTS + SPECIAL_TEXTS + CHAT_PROMPTS)
def test_decode_matches_llama_cpp_python(llama_cpp_pair, setting, text):
    """llama-cpp-python's detokenize drops the leading space behind a BOS; it copies each piece
    through a 32-byte buffer, so texts holding longer pieces are left out."""
    tok, llm = llama_cpp_pair(setting)
    ids = [tok.bos_token_id] + tok.encode(text)
    if max(len(tok.backend.id_to_token(i).encode()) for i in ids) > 32:
        pytest.skip("a piece longer than llama-cpp-python's 32-byte detokenize buffer")
    for special in (False, True):
        expected = llm.detokenize(ids, special=special).decode()
        assert tok.decode(ids, skip_special_tokens=not special) == expected


def _meta_of(path) -> dict:
    return dict(GGUFFile(path).meta)


def test_missing_scores_are_refused_naming_the_key(vocabulary, tmp_path):
    tokens, _, types = vocabulary
    path = write_spm_gguf(tmp_path / "no-scores.gguf", tokens, None, types)
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.scores"):
        tokenizer_from_gguf(_meta_of(path), str(path))


def test_scores_of_the_wrong_length_are_refused(vocabulary, tmp_path):
    tokens, scores, types = vocabulary
    path = write_spm_gguf(tmp_path / "short.gguf", tokens, scores[:-3], types)
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.scores"):
        tokenizer_from_gguf(_meta_of(path), str(path))


@pytest.mark.parametrize("change", [{"tokenizer.ggml.model": "t5"},
                                    {"general.architecture": "gemma2"}])
def test_unsupported_vocabularies_are_refused(vocabulary, tmp_path, change):
    tokens, scores, types = vocabulary
    path = write_spm_gguf(tmp_path / "spm.gguf", tokens, scores, types)
    with pytest.raises(UnsupportedModelError, match=str(path)):
        tokenizer_from_gguf({**_meta_of(path), **change}, str(path))
