"""Tokenizers by name: any tiktoken encoding ('gpt2' by default), 'byte', or a Hugging Face
tokenizer, a hub name (owner/name) or a folder (hftokenizer.py); and 'char', nanoGPT's
character-level vocabulary, which comes with its data (for_data). The tokenizer of a
model's data: tokenizer_of(), from the data's meta, a checkpoint's (data_meta()) or none.

'byte' is UTF-8 bytes as ids 0..255 plus an end-of-text id 256: it needs no download,
so a machine with no network can prepare, train and sample.

The tokenizers by name encode every Python str ('char' encodes its own characters, and names
any others in a UserError). A str can hold lone surrogates (U+D800..U+DFFF),
which UTF-8 cannot encode: JSON's "\\ud800" escapes make them, and so does a command-line
argument that is not UTF-8. Each becomes U+FFFD, the replacement character: tiktoken's
encode_ordinary does that itself, and _any_str does it for ours and Hugging Face's.
"""
import hashlib
import os
import shutil
from typing import Callable, NamedTuple, Optional

import numpy as np

from ddpgpt import tokenfile
from ddpgpt.errors import UserError
from ddpgpt.state import Saved


class Tokenizer(NamedTuple):
    name: str
    vocab_size: int  # ids are 0 .. vocab_size - 1, end-of-text included
    eot: int  # the end-of-text id, appended after every document ('char' has none: None)
    encode: Callable[[str], list]  # ordinary text: special-token strings are plain text
    decode: Callable[[list], str]
    decode_bytes: Callable[[list], bytes]  # the raw bytes, also of a split UTF-8 character
    fingerprint: str = ""  # a Hugging Face tokenizer's (hftokenizer.fingerprint_of); meta.json
    # records it, and a later load of the same name must find the same
    encode_batch: Optional[Callable[[list], list]] = None  # many texts at once, where faster
    save: Optional[Callable[[str, int], None]] = None  # (folder, max_length): a Hugging Face
    # tokenizer's own files, written from the tokenizer loaded (export.py)


def _any_str(encode, refusal=UnicodeEncodeError):
    """encode, with lone surrogates replaced by U+FFFD; text without them costs nothing more.
    refusal: what encode raises for them."""
    def encode_any(text):
        try:
            return encode(text)
        except refusal:
            # a valid surrogate pair passes through UTF-16 whole; a lone one is replaced
            return encode(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))

    return encode_any


def _byte_tokenizer():
    def encode(text):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).tolist()

    def decode_bytes(ids):
        return bytes(i for i in ids if i < 256)

    def decode(ids):
        return decode_bytes(ids).decode("utf-8", errors="replace")

    return Tokenizer("byte", 257, 256, _any_str(encode), decode, decode_bytes)


# tiktoken's 'gpt2' reads two files (vocab.bpe, encoder.json) that hold the same ranks, pattern
# and special tokens as the single r50k_base file: load that one, so one cached file serves both
_SAME_AS = {"gpt2": "r50k_base"}
GPT2_NAMES = ("gpt2", "r50k_base")  # so the two names are one vocabulary


def same_vocabulary(a, b):
    """Do tokenizers named a and b give the same ids?"""
    return a == b or {a, b} <= set(GPT2_NAMES)


def reads(tok, meta):
    """Are the ids of data described by meta tok's? A Hugging Face tokenizer's are where its
    fingerprint is the data's, under any name: an export's copy of the tokenizer the data was
    prepared with is that tokenizer."""
    if tok.fingerprint:
        return tok.fingerprint == meta.get("tokenizer_fingerprint")
    return same_vocabulary(meta.get("tokenizer"), tok.name)


def _tiktoken_tokenizer(name):
    import tiktoken

    try:
        enc = tiktoken.get_encoding(_SAME_AS.get(name, name))
    except ValueError as e:
        raise UserError(
            f"unknown tokenizer {name!r}: use 'byte', a tiktoken encoding "
            f"({', '.join(tiktoken.list_encoding_names())}), a Hugging Face hub name "
            f"(owner/name) or a folder that transformers.AutoTokenizer reads") from e
    except Exception as e:
        raise UserError(f"tiktoken could not load the {name!r} vocabulary ({type(e).__name__}: "
                        f"{e}). {offline_advice(_SAME_AS.get(name, name))}") from e
    return Tokenizer(name, enc.n_vocab, enc.eot_token, enc.encode_ordinary, enc.decode,
                     enc.decode_bytes)


def offline_advice(encoding):
    """How to give tiktoken an encoding's vocabulary with no network, as commands that run."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shipped = os.path.join(root, "tests", "fixtures", f"{encoding}.tiktoken")
    vocab = shipped if os.path.exists(shipped) else f"<a copy of {encoding}.tiktoken>"
    return (f"tiktoken downloads it once and caches it. With no network, install a copy into a "
            f"cache folder and point tiktoken at it: PYTHONPATH={root} python -c \"from "
            f"ddpgpt.tokenizer import "
            f"install_tiktoken_file; install_tiktoken_file('{vocab}', 'tiktoken_cache', "
            f"'{encoding}')\" && export TIKTOKEN_CACHE_DIR=$PWD/tiktoken_cache"
            f"{' (this checkout ships that copy)' if vocab == shipped else ''}. To prepare data "
            f"with no vocabulary to fetch at all: prepare.py --tokenizer=byte.")


def _char_tokenizer(stoi, itos):
    """nanoGPT's character-level vocabulary: character itos[i] is id i. It has no end-of-text
    (eot None): nanoGPT's character data is one text."""
    def encode(text):
        missing = sorted(set(text) - stoi.keys())
        if missing:
            raise UserError(f"the text holds characters that the character-level vocabulary of "
                            f"its data (nanoGPT's meta.pkl, {len(itos)} characters) does not: "
                            f"{''.join(missing)!r}. Use only its characters.")
        return [stoi[c] for c in text]

    def decode(ids):
        return "".join(itos[i] for i in ids if i < len(itos))

    return Tokenizer("char", len(itos), None, encode, decode,
                     lambda ids: decode(ids).encode("utf-8"))


def for_data(meta):
    """The tokenizer of data described by meta (tokenfile.read_meta): its character table, or
    the tokenizer it names, which must be the one the data was prepared with."""
    if meta["tokenizer"] == "char":
        return _char_tokenizer(meta["stoi"], meta["itos"])
    tok = get_tokenizer(meta["tokenizer"])
    recorded = meta.get("tokenizer_fingerprint", "")
    if tok.fingerprint != recorded:
        from ddpgpt import hftokenizer
        raise TokenizerChanged(hftokenizer.changed(tok.name, recorded, tok.fingerprint))
    return tok


class TokenizerChanged(UserError):
    """Data whose tokenizer is not the one it was prepared with: an error wherever it is met,
    also where a missing tokenizer would only leave bits per byte out."""


def get_tokenizer(name):
    if name == "byte":
        return _byte_tokenizer()
    import tiktoken
    from ddpgpt import hftokenizer  # without transformers, which it imports only when used
    if name not in tiktoken.list_encoding_names() and hftokenizer.is_hf_name(name):
        return hftokenizer.load(name)
    return _tiktoken_tokenizer(name)


def data_meta(state):
    """(the meta of a checkpoint's data, or None; where it came from). train.py keeps the data's
    meta.json (or what nanoGPT's meta.pkl holds) in the checkpoint; older checkpoints have
    none: read their data folder's (data_dir, or as nanoGPT's sample.py data/<dataset>)."""
    saved = Saved.of(state)
    meta, where, config = saved.data_meta, "the checkpoint's data_meta", saved.config
    data_dir = config.get("data_dir") or (config.get("dataset") and
                                          os.path.join("data", config["dataset"]))
    if meta is None and data_dir:
        meta, where = tokenfile.read_meta(data_dir), tokenfile.meta_path(data_dir)
    if meta and meta.get("tokenizer"):
        return meta, where
    return None, "nanoGPT's default, as the checkpoint names none"


def tokenizer_of(meta, vocab_size):
    """The tokenizer of data described by meta (GPT-2's where there is none, as nanoGPT's raw
    files are), which must not have more ids than the model can embed."""
    tok = for_data(meta) if meta else get_tokenizer("gpt2")
    check_ids_fit(tok.vocab_size, f"the tokenizer {tok.name!r}", vocab_size, "the model",
                  "put its data's meta.json in the data_dir it names.")
    return tok


def check_ids_fit(n_ids, tokens, vocab_size, model, fix):
    """A model embeds the ids 0 .. vocab_size - 1: data or a tokenizer (`tokens`) with more
    cannot be read by it. The one check of it, wherever data or a tokenizer meets a model
    (data opened for a model: sources.open_split; a tokenizer chosen for one: tokenizer_of,
    weights.load)."""
    if n_ids > vocab_size:
        raise UserError(f"{tokens} has {n_ids} token ids, more than the {vocab_size} that "
                        f"{model} embeds: {fix}")


def byte_lengths(tok, n_ids):
    """How many bytes of text each of a model's n_ids token ids (at least the tokenizer's) stands
    for, as an int64 array: what bits per byte divide by. End-of-text counts as one byte, the
    boundary between two documents, so that on byte-tokenized data bits per byte is exactly the
    loss in bits. Ids the tokenizer does not have (a model's vocabulary padding, gaps in a
    tiktoken vocabulary) count none."""
    lengths = np.zeros(n_ids, dtype=np.int64)
    for i in range(tok.vocab_size):
        try:
            lengths[i] = len(tok.decode_bytes([i]))
        except KeyError:
            pass
    if tok.eot is not None:
        lengths[tok.eot] = 1
    return lengths


def install_tiktoken_file(vocab_file, cache_dir, encoding="r50k_base"):
    """Put a copy of an encoding's .tiktoken file where tiktoken looks before it downloads, so
    that with TIKTOKEN_CACHE_DIR=cache_dir the encoding (and 'gpt2', for r50k_base) loads with
    no network. tiktoken names a cached file by the sha1 of the address it comes from."""
    url = f"https://openaipublic.blob.core.windows.net/encodings/{encoding}.tiktoken"
    os.makedirs(cache_dir, exist_ok=True)
    shutil.copy(vocab_file, os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest()))
