"""Export a checkpoint as a Hugging Face GPT-2 folder (a Qwen3 folder for arch='modern'), or a
checkpoint folder as one file (keys: ExportConfig in ddpgpt/settings.py, `export.py --help`):

  python export.py --out_dir=out-finetune-gpt2 --to=gpt2-finetuned   # its newest checkpoint
  python export.py --out_dir=out/ckpt_0000040.pt --to=gpt2-finetuned # a file (nanoGPT's too)
  python export.py --out_dir=out-fsdp/ckpt_0000040 --to=ckpt_0000040.pt  # a folder as one file

The folder computes the checkpoint's function, with its tokenizer's files (docs/evaluation.md
says what is written for each model and tokenizer); a --to that ends in .pt is one checkpoint
file with everything the source holds, as parallel=ddp writes them (docs/fsdp.md). --to must not
exist: it is written under a temporary name and renamed when complete."""
import json
import os
import shutil
import sys

import torch

from ddpgpt import checkpoint, configurator, errors, fileio, hf, logs, weights
from ddpgpt.errors import UserError
from ddpgpt.settings import ExportConfig
from ddpgpt.tokenizer import GPT2_NAMES, data_meta, tokenizer_of

LM_EVAL = ("lm_eval --model hf --model_args pretrained={} --tasks hellaswag --device cuda:0 "
           "--batch_size 16")


def tokenizer_note(tok, dest):
    if tok.fingerprint:
        return (f"The Hugging Face tokenizer `{tok.name}` that the data was prepared with, its "
                f"own files: `AutoTokenizer.from_pretrained({dest!r})` encodes as training did "
                f"with `add_special_tokens=False` (no BOS or EOS added) and "
                f"`split_special_tokens=True` (the strings of special tokens in a text are "
                f"text); id {tok.eot} ended every document in training and ends generation "
                f"(generation_config.json).")
    if tok.name in GPT2_NAMES:
        return (f"GPT-2's, converted from tiktoken's by transformers: `AutoTokenizer."
                f"from_pretrained({dest!r})` encodes as tiktoken does. Like Hugging Face's GPT-2 "
                f"tokenizer it reads `<|endoftext|>` in a text as the end-of-text token "
                f"({tok.eot}); in training that token came only between documents "
                f"(`split_special_tokens=True` encodes the string as text). Evaluate with "
                f"lm-evaluation-harness (`pip install \"lm_eval[hf]\"`):\n\n"
                f"    {LM_EVAL.format(dest)}")
    if tok.name == "char":
        return ("nanoGPT's character-level vocabulary, as a Hugging Face tokenizer of single "
                f"characters: `AutoTokenizer.from_pretrained({dest!r})` encodes and decodes as "
                "ddpgpt does (a character outside the vocabulary is an error). Id i is the i-th "
                "character of this JSON string, and there is no end-of-text:\n\n    " +
                json.dumps(tok.decode(range(tok.vocab_size))))
    if tok.name == "byte":
        return (f"ddpgpt's byte tokenizer, as a Hugging Face byte-level tokenizer with no "
                f"merges: a text's ids are its UTF-8 bytes (0..255), and {tok.eot}, "
                f"`<|endoftext|>`, is end-of-text, which followed every document in training "
                f"and ends generation (generation_config.json). "
                f"`AutoTokenizer.from_pretrained({dest!r})` encodes and decodes as ddpgpt does; "
                f"decode with `skip_special_tokens=True` to leave end-of-text out of the text, "
                f"as ddpgpt's decoding does, and like GPT-2's tokenizer it reads "
                f"`<|endoftext|>` in a text as the end-of-text token "
                f"(`split_special_tokens=True` encodes it as text). Without transformers:\n\n"
                "    ids = list(text.encode('utf-8'))\n"
                "    text = bytes(i for i in ids if i < 256).decode('utf-8', errors='replace')")
    return (f"tiktoken's {tok.name!r}; no tokenizer files are written for it: "
            f"`tiktoken.get_encoding({tok.name!r}).encode_ordinary(text)`, end-of-text "
            f"{tok.eot}.")


def readme(state, path, tok, dest):
    args = state["model_args"]
    if args.get("arch", "gpt2") == "modern":  # what the folder holds, its block in a few words
        kind, block = "Qwen3 (ddpgpt's arch='modern')", (
            f"Qwen3's block: RMSNorm, rotary position embeddings (theta "
            f"{args['rope_theta']:g}), QK-norm, SwiGLU, no biases, untied output head")
    else:
        gelu = {"none": "exact (`gelu`)", "tanh": "tanh approximation (`gelu_new`)"}[
            args.get("gelu_approximate", "none")]
        kind, block = "GPT-2", f"GELU {gelu}"
    text = (f"# A {kind} exported by ddpgpt\n\n"
            f"From `{path}` (iter {state['iter_num']}) by `python export.py`: "
            f"{args['n_layer']} layers, {args['n_head']} heads, {args['n_embd']} dimensions, "
            f"{args['block_size']} positions, {tok.vocab_size} token ids, {block}.\n\n"
            f"    from transformers import AutoModelForCausalLM\n"
            f"    model = AutoModelForCausalLM.from_pretrained({dest!r})\n\n"
            f"## Tokenizer\n\n{tokenizer_note(tok, dest)}\n")
    if padding := args["vocab_size"] - tok.vocab_size:
        text += (f"\n## Vocabulary\n\nThe checkpoint's embedding had {args['vocab_size']} rows: "
                 f"train.py pads the vocabulary to a multiple of 64, which runs faster. The "
                 f"{padding} padding rows belong to no token (ids >= {tok.vocab_size}: never in "
                 f"the data, never given probability by ddpgpt's loss or sampling): dropped.\n")
    return text


def write(dest, state, path, tok):
    """dest, complete or not at all."""
    tmp = fileio.tmp_path(dest)
    fileio.remove_stale_temporaries(os.path.dirname(os.path.abspath(dest)),
                                    of=os.path.basename(dest))  # a killed export's
    try:
        hf.save(checkpoint.model_state(state), state["model_args"], tok, tmp)
        hf.save_tokenizer(tok, tmp, state["model_args"]["block_size"])
        with open(os.path.join(tmp, "README.md"), "w") as f:
            f.write(readme(state, path, tok, dest))
        fileio.publish_folder(tmp, dest)
    except OSError as e:
        if os.path.lexists(dest):  # it was not there when this export began
            raise UserError(f"{dest} was made by another process while this export wrote it "
                            f"(a second export.py into the same --to?), and export.py never "
                            f"writes over a folder: this export's copy was removed, and {dest} "
                            f"is the other's. Remove it and run again, or give another "
                            f"--to.") from e
        raise UserError(f"could not write {dest} ({fileio.disk_full(e, dest) or e}); nothing is "
                        f"left there: free space or give another --to.") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv):
    cfg = configurator.parse(ExportConfig, argv, "export.py")
    if not cfg.to:
        raise UserError("give --to, the folder (or .pt file) to write, one that does not exist")
    logs.setup()  # the package's lines (a damaged checkpoint skipped), to stdout
    dest = cfg.to.rstrip("/") or cfg.to
    if os.path.lexists(dest):
        raise UserError(f"{dest} exists: export.py writes a new folder and never over an "
                        f"existing one. Remove it, or give another --to.")
    one_file = dest.endswith(".pt")
    state, path = weights.checkpoint_at(
        cfg.out_dir, "give the out_dir of a run, or one checkpoint (a file or a folder).",
        whole=checkpoint.TENSORS if one_file else ("model",))
    if one_file:
        try:
            with fileio.publishing(dest) as tmp:
                torch.save(state, tmp)
        except (OSError, RuntimeError) as e:  # torch.save reports a short write as RuntimeError
            raise UserError(f"could not write {dest} ({e}); nothing is left there: free space "
                            f"or give another --to.") from e
        print(f"export.py: wrote {path} (iter {state['iter_num']}) as {dest}")
        return 0
    meta, where = data_meta(state)
    tok = tokenizer_of(meta, state["model_args"]["vocab_size"])
    print(f"export.py: {path} (iter {state['iter_num']}), tokenizer {tok.name!r} from {where}")
    write(dest, state, path, tok)
    print(f"export.py: wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(errors.run(main, "export.py", sys.argv[1:]))
