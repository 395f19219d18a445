"""nanoGPT's character-level data (its data/shakespeare_char): uint16 train.bin and val.bin
beside a pickled meta.pkl of vocab_size, stoi and itos, no meta.json. Trained with its own
vocabulary, sampled in its own characters; a meta.pkl that would run code is refused, and
nothing runs. An export's tokenizer is its characters."""
import os
import pickle

import numpy as np
import pytest
import torch

from conftest import TINY, RunsCode, fails, python

# shakespeare_char's 65 characters, in the order its prepare.py gives them ids (sorted)
CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
TRAIN = [*TINY, "--gradient_accumulation_steps=1", "--max_iters=20", "--eval_interval=20",
         "--eval_iters=2"]
SEP = "\n---------------\n"


def write_char_data(folder, text):
    """What nanoGPT's data/shakespeare_char/prepare.py writes, written the way it does."""
    os.makedirs(folder)
    chars = sorted(set(text))
    stoi, itos = {ch: i for i, ch in enumerate(chars)}, {i: ch for i, ch in enumerate(chars)}
    cut = int(len(text) * 0.9)
    for name, part in (("train.bin", text[:cut]), ("val.bin", text[cut:])):
        np.array([stoi[c] for c in part], dtype=np.uint16).tofile(os.path.join(folder, name))
    with open(os.path.join(folder, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return folder


@pytest.fixture(scope="module")
def char_run(tmp_path_factory, session_env):
    """(data folder, out_dir) of a model trained on shakespeare_char-like data."""
    root = tmp_path_factory.mktemp("char")
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(list(CHARS), 30_000)) + CHARS  # every character, at least once
    data_dir = write_char_data(str(root / "data" / "shakespeare_char"), text)
    out = str(root / "out")
    p = python("train.py", f"--data_dir={data_dir}", f"--out_dir={out}", *TRAIN, env=session_env)
    assert "vocab_size = 128" in p.stdout  # 65, rounded up to a multiple of 64
    assert f"data: {data_dir} has nanoGPT's meta.pkl: 65 characters" in p.stdout
    return root, data_dir, out


@pytest.mark.slow
def test_trains_with_its_vocabulary_and_samples_its_characters(char_run, env):
    _, _, out = char_run
    p = python("sample.py", f"--out_dir={out}", "--max_new_tokens=200", "--num_samples=2",
               "--start=ROMEO:", env=env)
    samples = p.stdout.split(SEP)[:-1]
    assert len(samples) == 2 and all(s.startswith("ROMEO:") and len(s) == 206 for s in samples)
    assert set("".join(samples)) <= set(CHARS), p.stdout  # GPT-2's tokens decoded as garbage
    assert "tokenizer 'char' from the checkpoint's data_meta" in p.stderr


def test_a_nanogpt_checkpoint_finds_meta_pkl_as_nanogpt_does(char_run, env, tmp_path):
    """nanoGPT's own checkpoint names no data_dir, only config['dataset']: like nanoGPT's
    sample.py, read data/<dataset>/meta.pkl from the working directory."""
    root, data_dir, out = char_run
    (path,) = [os.path.join(out, f) for f in os.listdir(out) if f.startswith("ckpt_")]
    state = torch.load(path, map_location="cpu", weights_only=True)
    state["data_meta"], state["config"] = None, {"dataset": "shakespeare_char"}
    os.makedirs(tmp_path / "nanogpt")
    torch.save(state, tmp_path / "nanogpt" / "ckpt.pt")
    p = python("sample.py", f"--out_dir={tmp_path / 'nanogpt'}", "--max_new_tokens=50",
               "--num_samples=1", env=env, cwd=root)
    assert "tokenizer 'char' from data/shakespeare_char/meta.pkl" in p.stderr
    assert set(p.stdout.split(SEP)[0]) <= set(CHARS)


def test_a_nanogpt_checkpoint_without_its_meta_pkl_is_not_read_with_gpt2s_tokens(char_run, env,
                                                                              tmp_path):
    """Without data/<dataset>/meta.pkl the tokenizer is GPT-2's, as nanoGPT's; its 50257 ids
    do not fit the character-level model's 128."""
    _, _, out = char_run
    (path,) = [os.path.join(out, f) for f in os.listdir(out) if f.startswith("ckpt_")]
    state = torch.load(path, map_location="cpu", weights_only=True)
    state["data_meta"], state["config"] = None, {"dataset": "shakespeare_char"}
    torch.save(state, tmp_path / "ckpt.pt")
    p = fails("sample.py", f"--out_dir={tmp_path}", "--num_samples=1", env=env, cwd=tmp_path)
    assert p.stderr.strip().splitlines()[-1] == (
        "sample.py: error: the tokenizer 'gpt2' has 50257 token ids, more than the 128 that the "
        "model embeds: put its data's meta.json in the data_dir it names.")


def test_a_prompt_with_other_characters_names_them(char_run, env):
    _, _, out = char_run
    err = fails("sample.py", f"--out_dir={out}", "--start=Café ROMEO™", env=env).stderr
    assert "(nanoGPT's meta.pkl, 65 characters) does not: 'é™'. Use only its characters." in err


@pytest.mark.slow
def test_an_export_carries_its_characters_as_a_hugging_face_tokenizer(char_run, env, tmp_path):
    from transformers import AutoTokenizer

    _, _, out = char_run
    dest = tmp_path / "exported"
    python("export.py", f"--out_dir={out}", f"--to={dest}", env=env)
    tok = AutoTokenizer.from_pretrained(dest)
    text = "ROMEO:\nWhat, ho!  3 o'clock; and then?\n\n$&-."
    ids = [CHARS.index(c) for c in text]
    assert len(tok) == 65 and tok(text)["input_ids"] == ids and tok.decode(ids) == text
    with pytest.raises(Exception, match="a character not in the vocabulary"):
        tok("Café")  # as sample.py's prompt, an error, not a character silently dropped
    # sample.py reads the export with those characters (was: GPT-2's, refused for 65 ids)
    p = python("sample.py", f"--init_from={dest}", "--start=ROMEO:", "--max_new_tokens=20",
               "--num_samples=1", env=env)
    assert f"tokenizer '{dest}' (its tokenizer.json)" in p.stderr
    assert set(p.stdout.split(SEP)[0]) <= set(CHARS)
    message = fails("sample.py", f"--init_from={dest}", "--start=Café", env=env).stderr
    assert f"the tokenizer '{dest}' cannot encode the text 'Café' (Unk token" in message


@pytest.mark.parametrize("case", ["runs code", "damaged", "not a table"])
def test_a_bad_meta_pkl_is_one_paragraph_and_runs_nothing(case, env, tmp_path):
    folder = write_char_data(str(tmp_path / "data"), CHARS * 50)
    marker = tmp_path / "code_ran"
    contents = {"runs code": pickle.dumps({"vocab_size": 65, "x": RunsCode(marker)}),
                "damaged": pickle.dumps({"vocab_size": 65})[:-5],
                "not a table": pickle.dumps({"vocab_size": 65, "itos": list(CHARS)})}[case]
    with open(os.path.join(folder, "meta.pkl"), "wb") as f:
        f.write(contents)
    err = fails("train.py", f"--data_dir={folder}", f"--out_dir={tmp_path / 'out'}", *TRAIN,
                env=env).stderr
    message = err.strip().splitlines()[-1]
    expected = {
        "runs code": "meta.pkl was refused: loading it would execute code (it calls "
                     "posix.system), and a data folder's meta.pkl holds only plain data.",
        "damaged": "meta.pkl is not a readable pickle (",
        "not a table": "meta.pkl is not nanoGPT's character-level meta.pkl: it must be a dict "
                       "of vocab_size"}[case]
    assert message.startswith(f"train.py: error: {folder}/") and expected in message, message
    assert not marker.exists()
