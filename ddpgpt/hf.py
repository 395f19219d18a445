"""Hugging Face weights in and out: GPT2LMHeadModel <-> model.py's GPT (arch='gpt2'), and
Qwen3ForCausalLM <-> the modern block (arch='modern'); docs/evaluation.md says what an export holds.

nanoGPT took OpenAI's parameter names, so the two GPT-2 state dicts differ only in HF's Conv1D
layout, (in, out) (TRANSPOSED); HF's biases, which it always has (NO_BIAS: a model trained with
bias=False exports zeros, which compute the same function); and older HF checkpoints' causal-mask
buffers. The modern block is Qwen3's: the same nn.Linear layout, other names (QWEN3_BLOCK), no
biases, an untied head, and a config that must say exactly what model.py computes (qwen3_args_of).

transformers (and so torch) is imported inside the functions that need it: it takes seconds, a
run from scratch or from a checkpoint never needs it, and the settings read NAMES before torch.
"""
import json
import logging
import os
import tempfile

from ddpgpt.arch import RMS_EPS, swiglu_hidden
from ddpgpt.errors import UserError
from ddpgpt.tokenfile import GPT2_VOCAB_SIZE
from ddpgpt.tokenizer import GPT2_NAMES, byte_level_alphabet, get_tokenizer

log = logging.getLogger(__name__)

# (n_layer, n_head, n_embd, vocab_size) of OpenAI's GPT-2 weights by nanoGPT's names for them:
# nanoGPT's table, and GPT2Config's defaults
SHAPES = {name: (*shape, GPT2_VOCAB_SIZE) for name, shape in (
    ("gpt2", (12, 12, 768)), ("gpt2-medium", (24, 16, 1024)), ("gpt2-large", (36, 20, 1280)),
    ("gpt2-xl", (48, 25, 1600)))}
NAMES = tuple(SHAPES)
FOLDER_HINT = ("a Hugging Face GPT-2 folder holds config.json and model.safetensors, as "
               "save_pretrained or `hf download openai-community/gpt2 config.json "
               "model.safetensors --local-dir ./gpt2` writes them (or a Qwen3 folder that "
               "export.py wrote from an arch='modern' checkpoint)")
HUB_ORG = "openai-community"  # the hub repository that holds them
EOT = "<|endoftext|>"
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
NO_BIAS = ("wte.weight", "wpe.weight", "lm_head.weight")  # every other weight has a bias in HF
TO_APPROXIMATE = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
TO_ACTIVATION = {"none": "gelu", "tanh": "gelu_new"}
MODEL_TYPES = ("gpt2", "qwen3")  # config.json's model_type: GPT-2, or the modern block
# the modern block's names -> Qwen3ForCausalLM's, each then ".weight", in each block
# (h.N <-> model.layers.N) and outside them
QWEN3_BLOCK = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
               "attn.c_q": "self_attn.q_proj", "attn.c_k": "self_attn.k_proj",
               "attn.c_v": "self_attn.v_proj", "attn.c_proj": "self_attn.o_proj",
               "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm",
               "mlp.c_gate": "mlp.gate_proj", "mlp.c_fc": "mlp.up_proj",
               "mlp.c_proj": "mlp.down_proj"}
QWEN3_TOP = {"transformer.wte.weight": "model.embed_tokens.weight",
             "transformer.ln_f.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}


def _transformers():
    try:
        import huggingface_hub.utils
        import transformers
    except ImportError as e:
        raise UserError(f"GPT-2 weights need the transformers package ({e}): "
                        f"pip install -r requirements.txt") from e
    # transformers' bars over a model's tensors, loaded or written in a moment, are noise
    # among our lines; a download's, which can take minutes, stay as they were
    downloads = not huggingface_hub.utils.are_progress_bars_disabled()
    transformers.utils.logging.disable_progress_bar()
    if downloads:
        huggingface_hub.utils.enable_progress_bars()
    return transformers


# ---- the mapping ----

def model_args_of(config):
    """GPTConfig's arguments for an HF GPT2Config. A variant that model.py does not compute is
    a UserError: it would load, and compute another function."""
    unsupported = [f"{key}={getattr(config, key)!r}" for key, ok in (
        ("activation_function", config.activation_function in TO_APPROXIMATE),
        ("n_inner", config.n_inner in (None, 4 * config.n_embd)),
        ("layer_norm_epsilon", config.layer_norm_epsilon == 1e-5),
        ("scale_attn_weights", config.scale_attn_weights),
        ("scale_attn_by_inverse_layer_idx", not config.scale_attn_by_inverse_layer_idx),
        ("add_cross_attention", not config.add_cross_attention),
        ("tie_word_embeddings", config.tie_word_embeddings)) if not ok]
    if unsupported:
        raise UserError(f"the GPT-2 has {', '.join(unsupported)} in its config.json, a variant "
                        f"that model.py does not compute: use a standard GPT-2.")
    return dict(n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd,
                block_size=config.n_positions, vocab_size=config.vocab_size, bias=True,
                gelu_approximate=TO_APPROXIMATE[config.activation_function])


def config_of(args, vocab_size, eot):
    """The HF GPT2Config of GPTConfig's arguments, for a tokenizer of vocab_size ids."""
    dropout = args.get("dropout", 0.0)
    return _transformers().GPT2Config(
        vocab_size=vocab_size, n_positions=args["block_size"], n_embd=args["n_embd"],
        n_layer=args["n_layer"], n_head=args["n_head"],
        activation_function=TO_ACTIVATION[args.get("gelu_approximate", "none")],
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        bos_token_id=eot, eos_token_id=eot)


def from_hf_state(state):
    """An HF GPT2LMHeadModel state dict in model.py's layout."""
    return {k: v.t() if k.endswith(TRANSPOSED) else v for k, v in state.items()
            if not k.endswith((".attn.bias", ".attn.masked_bias"))}


def to_hf_state(state, vocab_size):
    """model.py's state dict in HF's layout, with the first vocab_size rows of the (tied)
    embedding: the rows train.py pads the vocabulary with belong to no token."""
    out = {}
    for k, v in state.items():
        if k.endswith(("wte.weight", "lm_head.weight")):
            v = v[:vocab_size]
        if k.endswith(".weight") and not k.endswith(NO_BIAS):  # its bias, if bias=False
            out.setdefault(k.removesuffix("weight") + "bias", v.new_zeros(len(v)))
        out[k] = v.t() if k.endswith(TRANSPOSED) else v
    return out


def qwen3_args_of(config):
    """GPTConfig's arguments (arch='modern') for an HF Qwen3Config; a variant that model.py does
    not compute is a UserError, as for GPT-2."""
    heads, width = config.num_attention_heads, config.hidden_size
    rope = dict(config.rope_parameters or {})
    unsupported = [f"{key}={getattr(config, key)!r}" for key, ok in (
        ("num_key_value_heads", config.num_key_value_heads in (None, heads)),
        ("head_dim", config.head_dim * heads == width),
        ("intermediate_size", config.intermediate_size == swiglu_hidden(width)),
        ("hidden_act", config.hidden_act == "silu"),
        ("rms_norm_eps", config.rms_norm_eps == RMS_EPS),
        ("attention_bias", not config.attention_bias),
        ("tie_word_embeddings", not config.tie_word_embeddings),
        ("use_sliding_window", not config.use_sliding_window),
        ("rope_parameters", rope.get("rope_type", "default") == "default")) if not ok]
    if unsupported:
        raise UserError(f"the Qwen3 has {', '.join(unsupported)} in its config.json, a variant "
                        f"that model.py's modern block does not compute: use a folder that "
                        f"export.py wrote.")
    return dict(arch="modern", n_layer=config.num_hidden_layers, n_head=heads, n_embd=width,
                block_size=config.max_position_embeddings, vocab_size=config.vocab_size,
                bias=False, rope_theta=float(rope["rope_theta"]))


def qwen3_config_of(args, vocab_size, eot):
    """The HF Qwen3Config of the modern block's arguments, for a tokenizer of vocab_size ids.
    Qwen3 has no residual dropout: the model's dropout becomes its attention dropout."""
    return _transformers().Qwen3Config(
        vocab_size=vocab_size, hidden_size=args["n_embd"],
        intermediate_size=swiglu_hidden(args["n_embd"]), num_hidden_layers=args["n_layer"],
        num_attention_heads=args["n_head"], num_key_value_heads=args["n_head"],
        head_dim=args["n_embd"] // args["n_head"], hidden_act="silu",
        max_position_embeddings=args["block_size"], rms_norm_eps=RMS_EPS,
        tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": args["rope_theta"]},
        attention_dropout=args.get("dropout", 0.0), bos_token_id=eot, eos_token_id=eot)


def _renamed(state, top, block, prefix, new_prefix):
    """state with the names outside the blocks mapped by top, and those in each block (prefix +
    its number) by block."""
    out = {}
    for k, v in state.items():
        layer, _, rest = k.removeprefix(prefix).removesuffix(".weight").partition(".")
        out[top[k] if k in top else f"{new_prefix}{layer}.{block[rest]}.weight"] = v
    return out


def to_qwen3_state(state, vocab_size):
    """The modern block's state dict in Qwen3's names, with the first vocab_size rows of the
    embedding and the head (the padding rows belong to no token)."""
    state = {k: v[:vocab_size] if k in ("transformer.wte.weight", "lm_head.weight") else v
             for k, v in state.items()}
    return _renamed(state, QWEN3_TOP, QWEN3_BLOCK, "transformer.h.", "model.layers.")


def from_qwen3_state(state):
    """A Qwen3ForCausalLM state dict in the modern block's names."""
    return _renamed(state, {v: k for k, v in QWEN3_TOP.items()},
                    {v: k for k, v in QWEN3_BLOCK.items()}, "model.layers.", "transformer.h.")


# ---- in: loading by name or folder ----

def check_folder(folder):
    """A folder's config.json, which must be a GPT-2's or a Qwen3's; checked before
    transformers is imported."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
        model_type = config.get("model_type")
    except FileNotFoundError as e:
        raise UserError(f"{folder} has no config.json: {FOLDER_HINT}.") from e
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"{path} cannot be read ({e}): {FOLDER_HINT}.") from e
    if model_type not in MODEL_TYPES:
        raise UserError(f"{folder} holds a {model_type!r} model (config.json's model_type), not a "
                        f"GPT-2 or a Qwen3 (the modern block), the models model.py computes: give "
                        f"a GPT-2 folder, one that export.py wrote, or one of {', '.join(NAMES)}.")
    return config


def check_init_from(init_from, keywords):
    """A UserError unless init_from is one of keywords, a name in NAMES or an existing folder."""
    if not (init_from in keywords or init_from in NAMES or os.path.isdir(init_from)):
        raise UserError(f"init_from={init_from!r} is none of {', '.join(keywords)}, GPT-2's "
                        f"weights by name ({', '.join(NAMES)}) or an existing folder; "
                        f"{FOLDER_HINT}.")


def shape(init_from):
    """(n_layer, n_head, n_embd, vocab_size) of GPT-2 weights by name or folder, without
    loading them (nor transformers): a folder's from its config.json."""
    if init_from in NAMES:
        return SHAPES[init_from]
    config = check_folder(init_from)
    return tuple(config.get(k, default) for k, default in
                 zip(("n_layer", "n_head", "n_embd", "vocab_size"), SHAPES["gpt2"]))


def cannot_load(init_from, error):
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if init_from not in NAMES:
        return f"cannot load the GPT-2 in {init_from} ({reason}): {FOLDER_HINT}."
    repo = f"{HUB_ORG}/{init_from}"
    return (f"GPT-2's weights {init_from!r} ({repo}) are not in Hugging Face's cache and cannot be "
            f"downloaded ({reason}). Run once with network access and without HF_HUB_OFFLINE=1 to "
            f"cache them (in $HF_HOME, by default ~/.cache/huggingface), or download the folder "
            f"where there is network, with `hf download {repo} config.json model.safetensors "
            f"--local-dir ./{init_from}`, copy it here and set --init_from=./{init_from}.")


def _fetch(load, init_from):
    """load(), with what goes wrong finding, downloading or reading the files as a UserError:
    transformers raises OSError for a missing file, other errors for a damaged one."""
    try:
        return load()
    except Exception as e:
        raise UserError(cannot_load(init_from, e)) from e


def load(init_from):
    """(weights in model.py's layout, GPTConfig's arguments) of GPT-2 weights: a name in NAMES
    (through Hugging Face's cache, downloaded the first time) or a local folder, which may
    also hold a Qwen3 (the modern block, as export.py writes it)."""
    import torch
    model_type = "gpt2" if init_from in NAMES else check_folder(init_from)["model_type"]
    transformers = _transformers()
    repo = f"{HUB_ORG}/{init_from}" if init_from in NAMES else init_from
    import huggingface_hub  # comes with transformers
    # unless HF_HUB_OFFLINE=1, the hub is asked about repo's files even when they are cached:
    # with no network, the user should not have to sit through its retries to learn the fix
    if init_from in NAMES and not huggingface_hub.constants.HF_HUB_OFFLINE:
        log.info(f"loading {repo} through Hugging Face's hub and its cache; without network, "
                 f"set HF_HUB_OFFLINE=1 to read the cache alone at once (else the hub is "
                 f"retried for about 30 s)")
    config_name, model_name, args_of, from_state, what = {
        "gpt2": ("GPT2Config", "GPT2LMHeadModel", model_args_of, from_hf_state, "GPT-2"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", qwen3_args_of, from_qwen3_state,
                  "Qwen3 (arch='modern')")}[model_type]
    config = _fetch(lambda: getattr(transformers, config_name).from_pretrained(repo), init_from)
    args = args_of(config)
    model = _fetch(lambda: getattr(transformers, model_name).from_pretrained(
        repo, config=config, dtype=torch.float32), init_from)
    log.info(f"loaded the {what} weights of {repo}: {model.num_parameters() / 1e6:.1f}M parameters")
    return from_state(model.state_dict()), args


# ---- out: writing a folder ----

def save(weights, args, tokenizer, folder):
    """Write model.py's weights as an HF GPT-2 (a Qwen3 for arch='modern') for tokenizer's ids
    into folder: config.json, generation_config.json and model.safetensors."""
    model_name, config, state = ("Qwen3ForCausalLM", qwen3_config_of, to_qwen3_state) \
        if args.get("arch", "gpt2") == "modern" else ("GPT2LMHeadModel", config_of, to_hf_state)
    model = getattr(_transformers(), model_name)(config(args, tokenizer.vocab_size, tokenizer.eot))
    model.load_state_dict(state(weights, tokenizer.vocab_size))
    model.save_pretrained(folder)


def save_gpt2_tokenizer(folder, max_length):
    """GPT-2's tokenizer files, so that AutoTokenizer.from_pretrained(folder) encodes as
    tiktoken does: transformers' own conversion of tiktoken's vocabulary."""
    transformers = _transformers()
    from transformers.integrations.tiktoken import convert_tiktoken_to_fast
    with tempfile.TemporaryDirectory() as scratch:
        convert_tiktoken_to_fast("r50k_base", scratch)  # 'gpt2' in the file tiktoken caches
        transformers.PreTrainedTokenizerFast(
            tokenizer_file=os.path.join(scratch, "tokenizer.json"), bos_token=EOT,
            eos_token=EOT, unk_token=EOT, model_max_length=max_length).save_pretrained(folder)


# ---- out: the tokenizer ----

def save_tokenizer(tok, folder, max_length):
    """Tokenizer files with which AutoTokenizer.from_pretrained(folder) encodes and decodes as
    tok does, where transformers can express it: True when written, False (none) for tiktoken
    encodings other than GPT-2's."""
    if tok.save:
        tok.save(folder, max_length)
    elif tok.name in GPT2_NAMES:
        save_gpt2_tokenizer(folder, max_length)
    elif tok.name in ("byte", "char"):
        (save_byte_tokenizer if tok.name == "byte" else save_char_tokenizer)(
            folder, tok, max_length)
    else:
        return False
    return True


def save_byte_tokenizer(folder, tok, max_length):
    """The byte tokenizer (ids 0..255 the UTF-8 bytes, tok.eot end-of-text) as a byte-level BPE
    with no merges: each byte-level character of the text is its own token, whose id is its byte;
    decoding reads the bytes as UTF-8, replacing what is not, as tokenizer.py does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {char: byte for byte, char in byte_level_alphabet().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(EOT, special=True)])  # id 256, after the bytes
    assert backend.token_to_id(EOT) == tok.eot
    _save_backend(backend, folder, max_length, eos=EOT)


def folder_tokenizer(folder):
    """The tokenizer.py name of the tokenizer a folder's weights read, from its tokenizer.json:
    'byte' for the byte tokenizer's (export.py's of a byte-level model); None for GPT-2's, or where
    there is none (tiktoken's 'gpt2' has the same ids); the folder itself for any other, a Hugging
    Face tokenizer whose ids the weights were trained on (export.py's of data one prepared)."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(path).get_vocab(with_added_tokens=True)
    of_byte = byte_level_alphabet()
    if vocab == {**{char: b for b, char in of_byte.items()}, EOT: len(of_byte)}:
        return "byte"
    # GPT-2's is compared with tiktoken's, token by token, where its size and end-of-text say it
    # may be: another tokenizer of GPT-2's size read with GPT-2's ids would give the model other
    # tokens than it was trained on
    if len(vocab) != GPT2_VOCAB_SIZE or vocab.get(EOT) != GPT2_VOCAB_SIZE - 1:
        return folder
    gpt2 = get_tokenizer("gpt2")
    same = all(vocab.get("".join(of_byte[b] for b in gpt2.decode_bytes([i]))) == i
               for i in range(gpt2.eot))
    return None if same else folder


def save_char_tokenizer(folder, tok, max_length):
    """nanoGPT's characters (id i: the i-th of its meta.pkl's itos) as a BPE of single
    characters with no merges. A character the vocabulary lacks is an error, as in
    tokenizer.py: the model's unknown token, which is not in the vocabulary, says so."""
    from tokenizers import Tokenizer, decoders, models
    chars = tok.decode(list(range(tok.vocab_size)))
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[],
                                   unk_token="[a character not in the vocabulary]"))
    backend.decoder = decoders.Fuse()  # the characters one after the other, nothing between
    _save_backend(backend, folder, max_length, eos=None)


def _save_backend(backend, folder, max_length, eos):
    special = {"bos_token": eos, "eos_token": eos} if eos else {}
    _transformers().PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=max_length,
                                            **special).save_pretrained(folder)
