"""Tokenizers by name: any tiktoken encoding ('gpt2' by default), 'byte', or a Hugging Face
tokenizer, a hub name (owner/name) or a folder (below); and 'char', nanoGPT's character-level
vocabulary, which comes with its data (for_data).

'byte' is UTF-8 bytes as ids 0..255 plus an end-of-text id 256: it needs no download,
so a machine with no network can prepare, train and sample.

The tokenizers by name encode every Python str ('char' encodes its own characters, and names
any others in a UserError). A str can hold lone surrogates (U+D800..U+DFFF),
which UTF-8 cannot encode: JSON's "\\ud800" escapes make them, and so does a command-line
argument that is not UTF-8. Each becomes U+FFFD, the replacement character: tiktoken's
encode_ordinary does that itself, and _any_str does it for ours and Hugging Face's."""
import contextlib
import hashlib
import logging
import os
import re
import shutil
import sys
from typing import Callable, NamedTuple, Optional

import numpy as np

from ddpgpt import tokenfile
from ddpgpt.errors import UserError
from ddpgpt.state import Saved

log = logging.getLogger(__name__)


class Tokenizer(NamedTuple):
    name: str
    vocab_size: int  # ids are 0 .. vocab_size - 1, end-of-text included
    eot: int  # the end-of-text id, appended after every document ('char' has none: None)
    encode: Callable[[str], list]  # ordinary text: special-token strings are plain text
    decode: Callable[[list], str]
    decode_bytes: Callable[[list], bytes]  # the raw bytes, also of a split UTF-8 character
    fingerprint: str = ""  # a Hugging Face tokenizer's (fingerprint_of); meta.json
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


def same_ids(a, b):
    """Do tokenizers a and b, each (name, fingerprint), give the same ids? A Hugging Face
    tokenizer is its fingerprint, under any name: a copy of its folder (an export's) is that
    tokenizer, and another saved over the folder is not. The others are their names."""
    return a[1] == b[1] if a[1] or b[1] else a[0] == b[0] or {a[0], b[0]} <= set(GPT2_NAMES)


def made_with(meta):
    """The (name, fingerprint) of the tokenizer of data described by meta, or by None."""
    return (meta or {}).get("tokenizer"), (meta or {}).get("tokenizer_fingerprint", "")


def reads(tok, meta):
    """Are the ids of data described by meta tok's?"""
    return same_ids((tok.name, tok.fingerprint), made_with(meta))


def _tiktoken_tokenizer(name):
    import tiktoken

    try:
        enc = tiktoken.get_encoding(_SAME_AS.get(name, name))
    except ValueError as e:
        raise UserError(f"unknown tokenizer {name!r}: use 'byte', a tiktoken encoding "
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
            f"ddpgpt.tokenizer import install_tiktoken_file; install_tiktoken_file('{vocab}', "
            f"'tiktoken_cache', '{encoding}')\" && export TIKTOKEN_CACHE_DIR=$PWD/tiktoken_cache"
            f"{' (this checkout ships that copy)' if vocab == shipped else ''}. To prepare data "
            f"with no vocabulary to fetch at all: prepare.py --tokenizer=byte.")


def _char_tokenizer(stoi, itos):
    """nanoGPT's character-level vocabulary: character itos[i] is id i. It has no end-of-text
    (eot None): nanoGPT's character data is one text."""
    def encode(text):
        if missing := sorted(set(text) - stoi.keys()):
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
        raise TokenizerChanged(
            f"the tokenizer {tok.name!r} is not the one the data was prepared with: it changed "
            f"since prepare.py recorded it in meta.json (fingerprint {recorded[:12]} then, "
            f"{tok.fingerprint[:12]} now), and its ids would not be the data's. Put back the "
            f"tokenizer the data was made with, or prepare the data again with "
            f"--tokenizer={tok.name}.")
    return tok


class TokenizerChanged(UserError):
    """Data whose tokenizer is not the one it was prepared with: an error wherever it is met,
    also where a missing tokenizer would only leave bits per byte out."""


def get_tokenizer(name):
    if name == "byte":
        return _byte_tokenizer()
    import tiktoken
    if name not in tiktoken.list_encoding_names() and (os.path.isdir(name) or "/" in name):
        return _hf_tokenizer(name)  # a folder, or a hub repository (owner/name)
    return _tiktoken_tokenizer(name)


def data_meta(state):
    """(the meta of a checkpoint's data, or None; where it came from). train.py keeps the data's
    meta.json (or what nanoGPT's meta.pkl holds) in the checkpoint; older checkpoints have
    none: read their data folder's (data_dir, or as nanoGPT's sample.py data/<dataset>)."""
    saved = Saved.of(state)
    meta, where = saved.data_meta, "the checkpoint's data_meta"
    if meta is None and saved.data_dir:
        meta, where = tokenfile.read_meta(saved.data_dir), tokenfile.meta_path(saved.data_dir)
    return (meta, where) if meta and meta.get("tokenizer") else \
        (None, "nanoGPT's default, as the checkpoint names none")


def tokenizer_of(meta, vocab_size):
    """The tokenizer of data described by meta (GPT-2's where there is none, as nanoGPT's raw
    files are), which must not have more ids than the model can embed."""
    tok = for_data(meta) if meta else get_tokenizer("gpt2")
    check_ids_fit(tok.vocab_size, f"the tokenizer {tok.name!r}", vocab_size, "the model",
                  "put its data's meta.json in the data_dir it names.")
    return tok


def check_ids_fit(n_ids, tokens, vocab_size, model, fix):
    """A model embeds the ids 0 .. vocab_size - 1: data or a tokenizer (`tokens`) with more cannot
    be read by it. The one check of it, wherever data or a tokenizer meets a model."""
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
        with contextlib.suppress(KeyError):
            lengths[i] = len(tok.decode_bytes([i]))
    if tok.eot is not None:
        lengths[tok.eot] = 1
    if tok.fingerprint and (kept := lengths[tok.encode(PROBE)].sum()) < len(PROBE):
        log.info(f"note: the tokenizer {tok.name!r} drops text (unknown words, or a pre-tokenizer "
                 f"or normalizer that leaves some out): {PROBE!r} decodes to {kept} of its "
                 f"{len(PROBE)} bytes. Bits per byte count the bytes its tokens decode to, so they "
                 f"read higher than the text's would, and do not compare with another tokenizer's.")
    return lengths


PROBE = "Two  spaces, a\ttab and a new\nline."  # what a Hugging Face tokenizer may drop


def install_tiktoken_file(vocab_file, cache_dir, encoding="r50k_base"):
    """Put a copy of an encoding's .tiktoken file where tiktoken looks before it downloads, so
    that with TIKTOKEN_CACHE_DIR=cache_dir the encoding (and 'gpt2', for r50k_base) loads with
    no network. tiktoken names a cached file by the sha1 of the address it comes from."""
    url = f"https://openaipublic.blob.core.windows.net/encodings/{encoding}.tiktoken"
    os.makedirs(cache_dir, exist_ok=True)
    shutil.copy(vocab_file, os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest()))


# ---- Hugging Face tokenizers: a hub name (owner/name) or a folder ----
#
# docs/data.md ("A Hugging Face tokenizer") says what they read and how; a document ends with
# the eos token, else the pad token, the rule of the Lightning prepare script our users came
# from. transformers is imported only when such a tokenizer is asked for: it takes seconds.

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte tokens


def name_of(name):
    """What meta.json records: a folder by its absolute path, so any working directory finds it."""
    return os.path.abspath(name) if os.path.isdir(name) else name


def _hf_tokenizer(name):
    """The Tokenizer of a hub name or folder."""
    hf = from_pretrained(name)
    backend = hf.backend_tokenizer
    vocab = backend.get_vocab(with_added_tokens=True)
    fingerprint = fingerprint_of(hf)
    backend.encode_special_tokens = True  # after the fingerprint, which is of the files alone
    to_bytes = {}  # made on the first call: only bits per byte need it
    # TypeError: how the tokenizers library refuses a lone surrogate
    any_str = _any_str(lambda text: backend.encode(text, add_special_tokens=False).ids, TypeError)

    def encode_text(text):
        """any_str, with what the tokenizer cannot encode a UserError: a text that only an
        unknown token it lacks would stand for (export.py's of nanoGPT's characters)."""
        try:
            return any_str(text)
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise UserError(f"the tokenizer {name_of(name)!r} cannot encode the text {text[:40]!r} "
                            f"({e}): give a text of what its vocabulary holds.") from e

    def encode_batch(texts):
        """Without the offsets that backend.encode computes: a third less CPU per token."""
        try:
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        except Exception:  # a lone surrogate in one of them (TypeError), or worse: one by one
            return [encode_text(text) for text in texts]

    def decode(ids):
        return backend.decode(ids, skip_special_tokens=False)

    def decode_bytes(ids):
        if not to_bytes:
            to_bytes.update(token_bytes(hf, vocab))
        return b"".join(to_bytes.get(i, b"") for i in ids)

    def save(folder, max_length):
        """Its own files, so that AutoTokenizer.from_pretrained(folder) encodes as training
        did: those loaded here, whose fingerprint the data's meta.json was checked against."""
        hf.model_max_length = max_length
        hf.save_pretrained(folder)

    eot = hf.eos_token_id if hf.eos_token_id is not None else hf.pad_token_id  # else None
    return Tokenizer(name_of(name), max(vocab.values()) + 1, eot, encode_text, decode,
                     decode_bytes, fingerprint, encode_batch, save)


def from_pretrained(name):
    """The transformers tokenizer of name, loaded or a UserError that says how to have it."""
    try:
        import transformers
    except ImportError as e:
        raise UserError(f"the Hugging Face tokenizer {name!r} needs the transformers package "
                        f"({e}): pip install -r requirements.txt") from e
    try:
        hf = transformers.AutoTokenizer.from_pretrained(name_of(name))
    except Exception as e:  # a missing file is an OSError, a damaged one anything
        raise UserError(cannot_load(name, e)) from e
    if getattr(hf, "backend_tokenizer", None) is None:
        raise UserError(f"{name!r} loads as {type(hf).__name__}, a slow (pure Python) "
                        f"tokenizer: prepare.py reads fast ones (the tokenizers library's "
                        f"tokenizer.json, or a sentencepiece tokenizer.model that transformers "
                        f"converts). Save it as a fast tokenizer (AutoTokenizer.from_pretrained("
                        f"..., use_fast=True).save_pretrained(folder)) and give that folder.")
    return hf


@contextlib.contextmanager
def torch_hidden():
    """For a process that never uses torch (prepare.py): transformers imports it wherever it
    can find it, half of a tokenizer's load (benchmarks/text/prepare_hf.md), and decides once per
    process whether it can. Hidden while it decides (None in sys.modules), then shown again,
    since other libraries take a name in sys.modules for a module (datasets does); its advisory
    line that it found no torch would only puzzle the user. Nothing where torch is imported."""
    if "torch" in sys.modules:
        yield
        return
    advice = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    sys.modules["torch"], os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = None, "1"
    try:
        yield
    finally:
        sys.modules.pop("torch", None)  # None still: an import of it in the block fails
        del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
        if advice is not None:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = advice


def cannot_load(name, error):
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if "expected u32" in reason:  # how the tokenizers library refuses an id past uint32
        return (f"{name} holds a token id past 4,294,967,295, uint32's largest ({reason}): "
                f"neither the tokenizers library nor ddpgpt's token files (uint16, or uint32 "
                f"past 65,535 ids) hold such ids. Give the tokenizer ids from 0 up, one per "
                f"token, and save it again.")
    if os.path.isabs(name) and not os.path.exists(name):  # meta.json's folders are absolute
        return (f"the tokenizer folder {name} does not exist: it was moved or deleted (a data "
                f"folder's meta.json names the tokenizer by the folder prepare.py read). Put "
                f"it back there, or link it there (ln -s <where it is now> {name}).")
    if os.path.isdir(name):
        return (f"{name} is not a tokenizer that transformers.AutoTokenizer reads ({reason}): "
                f"give a folder written by a tokenizer's save_pretrained (tokenizer.json, or "
                f"tokenizer.model with its tokenizer_config.json), a hub name such as "
                f"owner/name, 'byte' or a tiktoken encoding.")
    return (f"the Hugging Face tokenizer {name!r} is not in Hugging Face's cache and cannot be "
            f"downloaded ({reason}). Run once with network access and without HF_HUB_OFFLINE=1 "
            f"to cache it (in $HF_HOME, by default ~/.cache/huggingface), or download it where "
            f"there is network with `hf download {name} --local-dir ./tokenizer`, copy that "
            f"folder here and give --tokenizer=./tokenizer. A local folder that does not exist "
            f"is read as a hub name: check the path.")


def fingerprint_of(hf):
    """A hash of what decides the ids: the backend's whole definition (vocabulary, merges,
    normalizer, pre-tokenizer, added tokens) and the special tokens transformers adds."""
    h = hashlib.blake2b(hf.backend_tokenizer.to_str().encode(), digest_size=16)
    h.update(repr(sorted(hf.special_tokens_map.items())).encode())
    return h.hexdigest()


def token_bytes(hf, vocab):
    """{id: the bytes of text it stands for}, for bits per byte: a byte-level tokenizer's
    characters stand for GPT-2's bytes, sentencepiece's <0xNN> for its byte and '▁' for a space,
    anything else for its UTF-8; special tokens for none (byte_lengths counts end-of-text as 1)."""
    special = set(hf.all_special_ids) | {i for i, t in hf.added_tokens_decoder.items() if t.special}
    byte_level = "ByteLevel" in str(hf.backend_tokenizer.decoder)  # or in its Sequence
    of_char = {c: bytes([b]) for b, c in byte_level_alphabet().items()}
    table = {}
    for token, i in vocab.items():
        if i in special:
            continue
        if fallback := BYTE_FALLBACK.fullmatch(token):
            table[i] = bytes([int(fallback.group(1), 16)])
        elif byte_level and all(c in of_char for c in token):
            table[i] = b"".join(of_char[c] for c in token)
        else:
            table[i] = token.replace("\u2581", " ").encode("utf-8")
    return table


def byte_level_alphabet():
    """{byte: its character}: GPT-2's byte-level stand-ins (bytes_to_unicode in OpenAI's
    encoder.py), which the tokenizers library's ByteLevel pre-tokenizer and decoder use: the
    printable bytes stand for themselves, the others for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
