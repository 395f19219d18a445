"""Hugging Face tokenizers (tokenizer.py's third kind): a hub name, `owner/name`, which
huggingface_hub downloads once into its cache and reads from there after (HF_HUB_OFFLINE=1
too), or a local folder that transformers.AutoTokenizer.from_pretrained reads. Fast tokenizers
only (the `tokenizers` library's); a sentencepiece one (tokenizer.model) is converted to one by
transformers when sentencepiece is installed.

As tokenizer.py's others do, a text is encoded as ordinary text: no BOS or EOS added
(add_special_tokens=False) and the strings of special tokens encoded as text
(encode_special_tokens, transformers' split_special_tokens=True). A document ends with the
tokenizer's eos token, else its pad token (the rule of the Lightning prepare script our users
came from); prepare.py refuses one with neither, which sample.py and eval.py read with no
end-of-text (export.py's of nanoGPT's characters, whose folder is such a tokenizer).

meta.json records the name (a folder as its absolute path) and fingerprint_of(): every later
script loads the tokenizer by that name and refuses one whose fingerprint differs, so that no
script reads the ids with another vocabulary than prepare.py wrote them with.

transformers is imported only when such a tokenizer is asked for: it takes seconds.
"""
import hashlib
import os
import re

from ddpgpt.errors import UserError

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte tokens


def is_hf_name(name):
    """Is name a Hugging Face tokenizer's: a folder, or a hub repository (owner/name)?"""
    return os.path.isdir(name) or "/" in name


def name_of(name):
    """What meta.json records: a folder by its absolute path, so any working directory finds it."""
    return os.path.abspath(name) if os.path.isdir(name) else name


def load(name):
    """tokenizer.Tokenizer of a hub name or folder."""
    from ddpgpt.tokenizer import Tokenizer, _any_str
    hf = from_pretrained(name)
    backend = hf.backend_tokenizer
    vocab = backend.get_vocab(with_added_tokens=True)
    fingerprint = fingerprint_of(hf)
    backend.encode_special_tokens = True  # after the fingerprint, which is of the files alone
    to_bytes = {}  # made on the first call: only bits per byte need it

    def encode(text):
        return backend.encode(text, add_special_tokens=False).ids

    def encode_text(text):
        """any_str, with what the tokenizer cannot encode a UserError: a text that only an
        unknown token it lacks would stand for (export.py's of nanoGPT's characters)."""
        try:
            return any_str(text)
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise UserError(f"the tokenizer {name_of(name)!r} cannot encode the text "
                            f"{text[:40]!r} ({e}): give a text of what its vocabulary "
                            f"holds.") from e

    def encode_batch(texts):
        """Without the offsets that encode() computes: a third less CPU per token."""
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

    any_str = _any_str(encode, TypeError)  # how the tokenizers library refuses a lone surrogate
    return Tokenizer(name_of(name), max(vocab.values()) + 1, end_of_document(hf), encode_text,
                     decode, decode_bytes, fingerprint, encode_batch, save)


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


def cannot_load(name, error):
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if "expected u32" in reason:  # how the tokenizers library refuses an id past uint32
        return (f"{name} holds a token id past 4,294,967,295, uint32's largest ({reason}): "
                f"neither the tokenizers library nor ddpgpt's token files (uint16, or uint32 "
                f"past 65,535 ids) hold such ids. Give the tokenizer ids from 0 up, one per "
                f"token, and save it again.")
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


def end_of_document(hf):
    """The id that ends every document: eos, else pad; None where there is neither, which
    prepare.py refuses (no_end_of_document) and sample.py and eval.py read as 'char' is read,
    with no end-of-text (export.py's of nanoGPT's characters)."""
    for kind in ("eos", "pad"):
        if getattr(hf, f"{kind}_token_id") is not None:
            return getattr(hf, f"{kind}_token_id")
    return None


def no_end_of_document(name):
    return (f"the tokenizer {name!r} has neither an eos token nor a pad token, and prepare.py "
            f"ends every document with one of them (eos, else pad): give it an eos token and "
            f"save it again, e.g. tok = AutoTokenizer.from_pretrained({name_of(name)!r}); "
            f"tok.add_special_tokens({{'eos_token': '<|endoftext|>'}}); "
            f"tok.save_pretrained(folder), and pass --tokenizer=folder.")


def token_bytes(hf, vocab):
    """{id: the bytes of text it stands for}, for bits per byte: a byte-level tokenizer's
    characters stand for GPT-2's bytes (hf.byte_level_alphabet), sentencepiece's <0xNN> for
    its byte and its '▁' for a space; anything else is its text in UTF-8. Special tokens stand
    for none (tokenizer.byte_lengths counts end-of-text as one)."""
    from ddpgpt.hf import byte_level_alphabet
    special = set(hf.all_special_ids) | {i for i, t in hf.added_tokens_decoder.items()
                                         if t.special}
    byte_level = "ByteLevel" in str(hf.backend_tokenizer.decoder)  # or in its Sequence
    of_char = {c: bytes([b]) for b, c in byte_level_alphabet().items()}
    table = {}
    for token, i in vocab.items():
        if i in special:
            continue
        fallback = BYTE_FALLBACK.fullmatch(token)
        if fallback:
            table[i] = bytes([int(fallback.group(1), 16)])
        elif byte_level and all(c in of_char for c in token):
            table[i] = b"".join(of_char[c] for c in token)
        else:
            table[i] = token.replace("\u2581", " ").encode("utf-8")
    return table


def changed(name, recorded, now):
    return (f"the tokenizer {name!r} is not the one the data was prepared with: it changed "
            f"since prepare.py recorded it in meta.json (fingerprint {recorded[:12]} then, "
            f"{now[:12]} now), and its ids would not be the data's. Put back the tokenizer the "
            f"data was made with, or prepare the data again with --tokenizer={name}.")
