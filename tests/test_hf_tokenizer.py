"""prepare.py --tokenizer=<a Hugging Face tokenizer>, as a user runs it, with tokenizers the tests
make and save as folders AutoTokenizer reads: the token files hold AutoTokenizer's ids, each
document ended by eos (else pad), uint16 up to id 65,535 and uint32 past it; prepare -> train
(2 ranks) -> sample -> export reads them with the same tokenizer, the export's AutoTokenizer
encodes as training did, and sample.py and eval.py read the export with its own tokenizer
files. Bad tokenizers are one clear error each. data_mix's sources are of one tokenizer where
their fingerprints are, whatever the folders' names."""
import json
import logging
import math
import os
import shutil
import sysconfig
from collections import Counter

import numpy as np
import pytest

from ddpgpt import tokenfile
from ddpgpt.tokenizer import byte_lengths, get_tokenizer
from conftest import TINY, evals, fails, prepare_fails, python, torchrun, train_args

# tokenizers, sentencepiece and transformers are imported in the functions that use them, not
# here: each pytest-xdist worker imports every test file to collect it, for the worker that
# runs this file only

TEXTS = [*(open(os.path.join(sysconfig.get_paths()["stdlib"], f"{name}.py")).read()
           for name in ("textwrap", "shutil", "json/decoder")),
         "ünïcödé — 日本語 🎉\r\nand a line that says <eos> and <pad> as text", "x"]


def save_bpe(folder, **special):
    """A byte-level BPE of 400 ids trained on TEXTS, its special tokens (eos_token='<eos>',
    ...) as given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(special.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=backend, **special).save_pretrained(folder)
    return str(folder)


def save_word_level(folder, n_ids):
    """A word-level tokenizer of n_ids ids: fillers, then the words of TEXTS, then its eos
    <|end|> at the largest id, n_ids - 1, which ends every document in the token files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = sorted({w for text in TEXTS for w in text.split()})
    first_word = n_ids - 1 - len(words)
    vocab = {"<unk>": 0, **{f"filler{i}": i for i in range(1, first_word)},
             **{w: first_word + i for i, w in enumerate(words)}, "<|end|>": n_ids - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end|>",
                            unk_token="<unk>").save_pretrained(folder)
    return str(folder)


def save_id_past_uint32(folder):
    """save_bpe's, with one token's id past 4,294,967,295 in its tokenizer.json."""
    save_bpe(folder, eos_token="<eos>")
    with open(os.path.join(folder, "tokenizer.json")) as f:
        definition = json.load(f)
    definition["model"]["vocab"]["past uint32"] = 2**32
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(definition, f)
    return str(folder)


def save_sentencepiece(folder):
    """A sentencepiece unigram model (tokenizer.model), as Llama's tokenizers come."""
    from sentencepiece import SentencePieceTrainer
    os.makedirs(folder)
    SentencePieceTrainer.train(
        sentence_iterator=iter(line for text in TEXTS for line in text.splitlines()),
        model_prefix=os.path.join(folder, "tokenizer"), vocab_size=600, byte_fallback=True,
        minloglevel=2)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "eos_token": "</s>",
                   "bos_token": "<s>", "unk_token": "<unk>"}, f)
    return str(folder)


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory):
    """{kind: a folder}, and the corpus: TEXTS as a JSON lines file."""
    root = tmp_path_factory.mktemp("hf_tokenizers")
    with open(root / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in TEXTS)
    return root, {"bpe": save_bpe(root / "bpe", eos_token="<eos>"),
                  "pad only": save_bpe(root / "pad", pad_token="<pad>"),
                  "neither": save_bpe(root / "neither", unk_token="<unk>"),
                  "65,536 ids": save_word_level(root / "65536", 2**16),
                  "65,537 ids": save_word_level(root / "65537", 2**16 + 1),
                  "an id past uint32": save_id_past_uint32(root / "past_uint32"),
                  "sentencepiece": save_sentencepiece(root / "sp")}


def prepare(env, root, tokenizer, out_dir):
    python("prepare.py", f"--dataset={root / 'docs.jsonl'}", f"--tokenizer={tokenizer}",
           "--val_docs=1", f"--out_dir={out_dir}", "--num_proc=2", env=env)
    return json.loads((out_dir / tokenfile.META_NAME).read_text())


@pytest.fixture(scope="module")
def prepared(tokenizers_dir, tmp_path_factory, session_env):
    """prepared(kind): (data_dir, meta) of the corpus prepared with that tokenizer, once per
    module: the pipeline reads the data its prepare test checked."""
    root, folders = tokenizers_dir
    runs = {}

    def prepared_with(kind):
        if kind not in runs:
            data = tmp_path_factory.mktemp("hf_data") / "data"
            runs[kind] = data, prepare(session_env, root, folders[kind], data)
        return runs[kind]

    return prepared_with


def documents(out_dir, meta):
    """Each document's ids, end-of-text included, from the token files."""
    docs = []
    for split in tokenfile.SPLITS:
        tokens = np.fromfile(out_dir / f"{split}.bin", dtype=meta["dtype"]).tolist()
        ends = [i for i, t in enumerate(tokens) if t == meta["eot_token"]]
        docs += [tuple(tokens[a + 1:b + 1]) for a, b in zip([-1, *ends], ends)]
    return docs


def encoded(hf, eot):
    """What training's ids must be: AutoTokenizer's, special strings as text, eot after each."""
    return Counter(tuple(hf(text, add_special_tokens=False, split_special_tokens=True)
                         ["input_ids"] + [eot]) for text in TEXTS)


@pytest.mark.parametrize("kind,eot,dtype", [("bpe", "<eos>", "uint16"),
                                            ("pad only", "<pad>", "uint16"),
                                            ("65,536 ids", "<|end|>", "uint16"),
                                            ("65,537 ids", "<|end|>", "uint32"),
                                            ("sentencepiece", "</s>", "uint16")])
def test_prepare_writes_autotokenizers_ids_ended_by_eos_else_pad(kind, eot, dtype,
                                                                   tokenizers_dir, prepared):
    from transformers import AutoTokenizer
    folders = tokenizers_dir[1]
    data, meta = prepared(kind)
    hf = AutoTokenizer.from_pretrained(folders[kind])
    assert (meta["tokenizer"], meta["dtype"], meta["eot_token"], meta["vocab_size"]) == \
        (folders[kind], dtype, hf.convert_tokens_to_ids(eot), max(hf.get_vocab().values()) + 1)
    assert Counter(documents(data, meta)) == encoded(hf, meta["eot_token"])


def test_bits_per_byte_count_the_bytes_each_token_stands_for(tokenizers_dir, monkeypatch):
    """byte_lengths of a document's ids add up to its UTF-8 bytes (end-of-text one more), for a
    byte-level BPE and for sentencepiece's '▁' and <0xNN> tokens alike (sentencepiece puts a
    '▁' before a text: one more)."""
    _, folders = tokenizers_dir
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for kind in ("bpe", "sentencepiece"):
        tok = get_tokenizer(folders[kind])
        lengths = byte_lengths(tok, tok.vocab_size)
        for text in TEXTS[2:]:
            ids = tok.encode(text) + [tok.eot]
            prefix = kind == "sentencepiece"
            assert lengths[ids].sum() == len(text.encode("utf-8")) + 1 + prefix, (kind, text)


@pytest.mark.parametrize("kind, drops", [("bpe", False), ("65,536 ids", True)])
def test_a_tokenizer_that_drops_text_is_said_to_make_bits_per_byte_higher(
        kind, drops, tokenizers_dir, monkeypatch, caplog):
    """A word-level tokenizer split at white space decodes to fewer bytes than its text: its
    bits per byte read 1.47x too high on one corpus, with no word."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = get_tokenizer(tokenizers_dir[1][kind])
    with caplog.at_level(logging.INFO, logger="ddpgpt.tokenizer"):
        byte_lengths(tok, tok.vocab_size)
    assert (f"note: the tokenizer {tok.name!r} drops text" in caplog.text) == drops, caplog.text


def test_a_lone_surrogate_is_encoded_as_the_replacement_character(tokenizers_dir, monkeypatch):
    """As with tiktoken and the byte tokenizer (JSON's "\\ud800" makes one), alone or in a batch,
    which the tokenizers library refuses whole."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = get_tokenizer(tokenizers_dir[1]["bpe"])
    assert tok.encode("a \ud800 b") == tok.encode("a \ufffd b")
    assert tok.encode_batch(["x", "a \ud800 b"]) == [tok.encode("x"), tok.encode("a \ufffd b")]


@pytest.mark.parametrize("case", ["neither eos nor pad", "not a tokenizer", "hub name offline",
                                  "an id past uint32"])
def test_a_tokenizer_prepare_cannot_use_is_one_clear_error(case, tokenizers_dir, env, tmp_path):
    root, folders = tokenizers_dir
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("not a tokenizer")
    tokenizer, named = {
        "neither eos nor pad": (folders["neither"], "has neither an eos token nor a pad token"),
        "not a tokenizer": (tmp_path / "notes", "is not a tokenizer that transformers."
                                                "AutoTokenizer reads"),
        "hub name offline": ("nobody-xyz/no-such-tokenizer", "HF_HUB_OFFLINE=1"),
        "an id past uint32": (folders["an id past uint32"], "holds a token id past "
                                                            "4,294,967,295")}[case]
    message = prepare_fails(tmp_path, f"--dataset={root / 'docs.jsonl'}",
                            f"--tokenizer={tokenizer}", "--val_docs=1", "--num_proc=1", env=env)
    assert str(tokenizer) in message and named in message, message


# ---- the whole way: prepare -> train on 2 ranks -> sample -> eval -> export ----

@pytest.fixture(scope="module")
def pipeline(prepared, tmp_path_factory, session_env):
    """(data_dir, out_dir, export) of a BPE tokenizer's data, a run of 4 steps on 2 ranks, and
    its export."""
    data, _ = prepared("bpe")
    work = tmp_path_factory.mktemp("hf_pipeline")
    torchrun(2, "train.py", *train_args(data, work / "out", "--max_iters=4", "--eval_interval=4",
                                        "--gradient_accumulation_steps=2"), env=session_env)
    python("export.py", f"--out_dir={work / 'out'}", f"--to={work / 'export'}", env=session_env)
    return data, work / "out", work / "export"


def greedy_sample(source, env):
    """sample.py's greedy continuation of 'def ' from source: --out_dir=<a run> or
    --init_from=<an export>."""
    return python("sample.py", source, "--start=def ", "--num_samples=1", "--max_new_tokens=8",
                  "--top_k=1", "--device=cpu", env=env)


@pytest.fixture(scope="module")
def from_the_run(pipeline, session_env):
    _, out, _ = pipeline
    return greedy_sample(f"--out_dir={out}", session_env)


@pytest.mark.slow
def test_sample_reads_the_run_with_the_prepared_tokenizer(from_the_run, pipeline, tokenizers_dir):
    _, out, _ = pipeline
    assert from_the_run.stdout.startswith("def ") and \
        f"tokenizer '{tokenizers_dir[1]['bpe']}'" in from_the_run.stderr, from_the_run.stderr
    trained = evals(out)[-1]
    assert trained["iter"] == 4 and math.isfinite(trained["val_bpb"])


@pytest.mark.slow
def test_sample_and_eval_of_the_export_read_the_tokenizer_files_it_carries(from_the_run,
                                                                          pipeline, env):
    """--init_from=<the export>: its own tokenizer files, not GPT-2's (which reads ids the
    model was never trained on, or is refused for its 400 ids), encode the prompt and the
    val data's tokens are accepted as the same tokenizer's under another name: the run's
    greedy text, and the val loss and bits per byte the run logged at its last checkpoint, on
    the same 4 x 4 windows (eval.py gives what training logged: test_eval.py)."""
    data, out, export = pipeline
    sample = greedy_sample(f"--init_from={export}", env)
    assert f"tokenizer '{export}' (its tokenizer.json)" in sample.stderr, sample.stderr
    assert sample.stdout == from_the_run.stdout
    p = python("eval.py", f"--init_from={export}", f"--data_dir={data}", "--hellaswag=False",
               "--eval_iters=4", "--batch_size=4", "--device=cpu", env=env)
    result, trained = json.loads(p.stdout.splitlines()[-1]), evals(out)[-1]
    # the same windows and bytes per token: bits per byte over loss is tokens over bytes; the
    # export drops the padding rows of the vocabulary, to which the run's loss gave no
    # probability; 2 ranks' sums then, 1 rank's now: float rounding
    ratio = result["val_bpb"] / result["val_loss"]
    assert ratio == pytest.approx(trained["val_bpb"] / trained["val_loss"], rel=1e-6)
    assert result["val_loss"] == pytest.approx(trained["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_the_exports_autotokenizer_encodes_exactly_as_training_did(pipeline, tokenizers_dir):
    from transformers import AutoTokenizer
    data, _, export = pipeline
    meta = json.loads((data / tokenfile.META_NAME).read_text())
    hf = AutoTokenizer.from_pretrained(export)
    assert Counter(documents(data, meta)) == encoded(hf, meta["eot_token"])
    assert hf.model_max_length == 32 and hf.eos_token_id == meta["eot_token"]
    generation = json.loads((export / "generation_config.json").read_text())
    assert generation["eos_token_id"] == meta["eot_token"]
    assert "split_special_tokens=True" in (export / "README.md").read_text()


@pytest.mark.slow
def test_a_tokenizer_changed_after_prepare_is_refused_by_train_and_sample(pipeline, tokenizers_dir,
                                                                         env, tmp_path):
    """The pipeline's tokenizer folder moved, then saved again as another tokenizer; the
    folder is put back after, for the other tests that read it. Moved, it was read as a hub
    name not in the cache, with the advice to give sample.py a --tokenizer key it lacks."""
    data, out, _ = pipeline
    tok = tokenizers_dir[1]["bpe"]
    os.rename(tok, tmp_path / "kept")
    try:
        message = fails("sample.py", f"--out_dir={out}", "--device=cpu", env=env).stderr
        assert f"sample.py: error: the tokenizer folder {tok} does not exist: it was moved or " \
               f"deleted" in message and "hub" not in message, message
        save_bpe(tok, eos_token="<|endoftext|>")  # the same folder, another tokenizer
        for script, args in (("train.py", train_args(data, tmp_path / "out")),
                             ("sample.py", [f"--out_dir={out}", "--device=cpu"])):
            message = fails(script, *args, env=env).stderr.strip().splitlines()[-1]
            assert message.startswith(f"{script}: error: the tokenizer '{tok}' is not the one "
                                      f"the data was prepared with"), message
            assert f"prepare the data again with --tokenizer={tok}." in message, message
    finally:
        shutil.rmtree(tok, ignore_errors=True)
        os.rename(tmp_path / "kept", tok)


# ---- data_mix: sources of one Hugging Face tokenizer are those of one fingerprint ----

@pytest.fixture(scope="module")
def saved_over(tokenizers_dir, tmp_path_factory, session_env):
    """(data_a, data_b): the corpus prepared with a copy of the BPE tokenizer's folder, then
    with another 400-id tokenizer saved over that folder."""
    root, folders = tokenizers_dir
    work = tmp_path_factory.mktemp("saved_over")
    tok = shutil.copytree(folders["bpe"], work / "tok")
    prepare(session_env, root, tok, work / "a")
    shutil.rmtree(tok)
    save_bpe(tok, eos_token="<|endoftext|>")
    prepare(session_env, root, tok, work / "b")
    return work / "a", work / "b"


MIX_STEP = [*TINY, "--max_iters=1", "--gradient_accumulation_steps=1", "--eval_iters=1"]


@pytest.mark.parametrize("order", ["stale source first", "stale source second"])
def test_a_mix_of_a_tokenizer_folder_saved_over_between_prepares_is_refused(order, saved_over,
                                                                            env, tmp_path):
    """Both sources name the folder. With the data of the tokenizer it holds now first, train.py
    trained on both, reading the stale source's ids with the wrong vocabulary."""
    first, second = saved_over if order == "stale source first" else saved_over[::-1]
    err = fails("train.py", f"--data_mix={first}=1,{second}=1", f"--out_dir={tmp_path / 'out'}",
                *MIX_STEP, env=env).stderr
    assert "error: the data_mix sources were not made with one tokenizer (" in err and \
        err.count(" (fingerprint ") == 2, err


def test_a_mix_of_data_made_with_copies_of_one_tokenizer_trains(prepared, saved_over, env,
                                                                tmp_path):
    """The BPE folder and its copy, one prepare each: refused as 'not made with one tokenizer',
    though both meta.json files record the same fingerprint."""
    p = python("train.py", f"--data_mix={prepared('bpe')[0]}=1,{saved_over[0]}=1",
               f"--out_dir={tmp_path / 'out'}", *MIX_STEP, env=env)
    assert "50.00% of the samples" in p.stdout
