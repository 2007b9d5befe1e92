"""Randomly initialised Qwen2 models of real architectures: for costs, not for learning.

    python -m rlfleet.tools.model_shapes --shape qwen2-0.5b --out /tmp/qwen2-0.5b [--dtype bfloat16|float32] [--seed N]
    python -m rlfleet.tools.model_shapes --list

The shipped tiny-qwen2 (tools/build_model.py) has 0.42M parameters, too few for memory,
step time, weight publication or engine start-up to show their real costs. A shape here
is one row of SHAPES (data, not code); its weights are random, so it learns nothing useful:

- ``qwen2-100m``: 98,335,488 parameters. hidden 768, 12 layers, 12 attention heads
  sharing 2 key/value heads (Qwen2-1.5B's grouping), intermediate 2048 (8/3 x hidden),
  vocabulary 32768, tied embeddings: a ~100M model for tests and CPU benchmarks.
- ``qwen2-0.5b``: 494,032,768 parameters. Qwen2-0.5B's architecture: hidden 896, 24
  layers, 14 heads, 2 key/value heads, intermediate 4864, vocabulary 151936, tied.

Both use Qwen2's rope_theta 1e6, 32768 positions and rms_norm_eps 1e-6. ``count_params``
computes the counts from the config (tied embedding counted once).

The folder holds what the engines and the trainer load: config.json (a Qwen2Config with
its dtype), model.safetensors (transformers' ``save_pretrained``; sharded with an index
above ``--max-shard-size``, but the rollout's lean loader reads one file only, so the
default keeps one), generation_config.json, tokenizer.json + tokenizer_config.json, and
shape.json (shape name, parameter count, seed, dtype: what a benchmark reports).

The tokenizer fills the vocabulary exactly (len(tokenizer) == vocab_size): the model
samples any id, and the env-host refuses a token id the tokenizer does not have
(turn_codec.vocab_size). The real Qwen2 tokenizer cannot be downloaded here, so it is a
synthetic byte-level BPE (``synthetic_bpe``), a Qwen2Tokenizer like tiny-qwen2's.

Weights: the model is laid out on the meta device, allocated once in the target dtype,
then initialised by transformers' own Qwen2 init from ``--seed``: no float32 copy of a
bfloat16 model, and the same seed gives the same bytes (docs/guide/models.md, "Shapes of
real size").
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import string
import time
from pathlib import Path
from typing import Any

SHAPE_FILE = "shape.json"

# Qwen2's own choices, shared by every shape.
_QWEN2 = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
          "max_position_embeddings": 32768, "tie_word_embeddings": True}

# name -> Qwen2Config fields, as config.json holds them (transformers 5 keeps rope_theta in
# rope_parameters).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-100m": {"vocab_size": 32768, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                   "num_attention_heads": 12, "num_key_value_heads": 2, **_QWEN2},
    "qwen2-0.5b": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                   "num_attention_heads": 14, "num_key_value_heads": 2, **_QWEN2},
}

# GPT-2 / Qwen2 end and chat tokens, the last ids of the vocabulary; the first is eos and pad
# (as in Qwen2's base models).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DTYPES = ("bfloat16", "float32")


def shape_fields(name: str, **overrides: Any) -> dict[str, Any]:
    """The config fields of shape `name`, with `overrides` (existing fields only) applied."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known shapes: {', '.join(sorted(SHAPES))}")
    fields = copy.deepcopy(SHAPES[name])  # Qwen2Config may rewrite rope_parameters in place
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"{name}: cannot override {unknown}; fields are {sorted(fields)}")
    return {**fields, **overrides}


def count_params(fields: dict[str, Any]) -> int:
    """Parameters of a Qwen2ForCausalLM with these fields (q/k/v have biases, o and the MLP
    none; two RMSNorm weights per layer and one final; the tied lm_head counted once)."""
    hidden, layers, vocab = fields["hidden_size"], fields["num_hidden_layers"], fields["vocab_size"]
    head_dim = hidden // fields["num_attention_heads"]
    q, kv = fields["num_attention_heads"] * head_dim, fields["num_key_value_heads"] * head_dim
    attention = (hidden + 1) * q + 2 * (hidden + 1) * kv + q * hidden
    layer = attention + 3 * hidden * fields["intermediate_size"] + 2 * hidden
    heads = 1 if fields["tie_word_embeddings"] else 2
    return heads * vocab * hidden + layers * layer + hidden


def synthetic_bpe(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of exactly `vocab_size` tokens, and its merges, from no data.

    Ids 0-255 are GPT-2's byte symbols (any text encodes, and decodes back exactly); then
    words of growing length, a start (a letter, or "Ġ": a leading space) followed by
    lower-case letters, each merged from its prefix and last letter, shortest first
    ("Ġt", ..., "Ġthe", ...); the SPECIAL_TOKENS last. An English sentence comes to 2.1
    bytes a token at either shape's vocabulary (a trained BPE packs more).
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    n_words = vocab_size - 256 - len(SPECIAL_TOKENS)
    if n_words < 0:
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes and special tokens), "
                         f"got {vocab_size}")
    vocab = {sym: i for i, sym in enumerate(bytes_to_unicode().values())}
    merges: list[tuple[str, str]] = []
    level = ["Ġ", *string.ascii_letters]
    while len(merges) < n_words:
        level = [word + c for word in level for c in string.ascii_lowercase]
        for word in level[:n_words - len(merges)]:
            merges.append((word[:-1], word[-1]))
            vocab[word] = len(vocab)
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    return vocab, merges


def build_tokenizer(vocab_size: int, max_length: int) -> Any:
    """A Qwen2Tokenizer over ``synthetic_bpe``: transformers 5 loads any model_type "qwen2"
    checkpoint's tokenizer as this class, so it loads as it was saved (build_model.py)."""
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab, merges = synthetic_bpe(vocab_size)
    end = SPECIAL_TOKENS[0]
    return Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token=end,
                          pad_token=end, extra_special_tokens=SPECIAL_TOKENS[1:],
                          clean_up_tokenization_spaces=False, model_max_length=max_length)


def build_model(fields: dict[str, Any], dtype: str, seed: int, eos_id: int) -> Any:
    """A Qwen2ForCausalLM of these fields in `dtype`, weights from transformers' init."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**fields, bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id)
    # On meta nothing is allocated or initialised; to_empty allocates every tensor once, in
    # `dtype`, and init_weights fills them (and recomputes the rotary buffers, which
    # to_empty leaves as garbage).
    with torch.device("meta"):
        model = Qwen2ForCausalLM._from_config(config, dtype=getattr(torch, dtype))
    model.to_empty(device="cpu")
    # to_empty unties lm_head from the embedding: tied again before the init, or both are
    # filled (a second embedding in memory, 0.5 GiB for qwen2-0.5b in float32). The
    # embedding's init then fills lm_head too; transformers' flag skips a second draw.
    model.tie_weights()
    if fields["tie_word_embeddings"]:
        model.lm_head._is_hf_initialized = True
    with torch.random.fork_rng(devices=[]):  # the caller's global RNG stream is left as it was
        torch.manual_seed(seed)
        model.init_weights()
    return model.eval()


def write_shape(name: str, out: str | Path, *, dtype: str = "bfloat16", seed: int = 0,
                max_shard_size: str = "50GB", **overrides: Any) -> dict[str, Any]:
    """Write shape `name` (with `overrides`) to `out`; returns the shape.json record plus
    the timings, which are not written (the folder depends on the seed alone)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    fields = shape_fields(name, **overrides)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tokenizer = build_tokenizer(fields["vocab_size"], fields["max_position_embeddings"])
    tokenizer.save_pretrained(str(out))
    t1 = time.perf_counter()
    model = build_model(fields, dtype, seed, tokenizer.eos_token_id)
    t2 = time.perf_counter()
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    t3 = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())  # tied weights once, as count_params
    record = {"shape": name, "params": params, "seed": seed, "dtype": dtype, "overrides": overrides,
              "random_weights": True, "tokenizer": "synthetic byte-level BPE (tools/model_shapes.py)"}
    (out / SHAPE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return {**record, "tokenizer_s": round(t1 - t0, 2), "init_s": round(t2 - t1, 2),
            "save_s": round(t3 - t2, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlfleet.tools.model_shapes", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), help="the architecture to write")
    p.add_argument("--out", type=Path, help="the model folder to write")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="of the saved weights")
    p.add_argument("--seed", type=int, default=0, help="of the random weights")
    p.add_argument("--max-shard-size", default="50GB",
                   help="safetensors shard size (transformers' notation); the default keeps one file")
    p.add_argument("--list", action="store_true", help="print the shapes and their parameter counts")
    args = p.parse_args(argv)
    if args.list:
        for name in sorted(SHAPES):
            print(f"{name}: {count_params(SHAPES[name]):,} parameters, {SHAPES[name]}")
        return 0
    if args.shape is None or args.out is None:
        p.error("--shape and --out are required (or --list)")
    start = time.perf_counter()
    record = write_shape(args.shape, args.out, dtype=args.dtype, seed=args.seed,
                         max_shard_size=args.max_shard_size)
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    # ru_maxrss is in KiB on Linux: the process's peak, imports included.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"wrote {args.out}: {args.shape}, {record['params']:,} parameters, {args.dtype}, seed {args.seed}; "
          f"{size / 1e6:.0f} MB; {time.perf_counter() - start:.1f} s (tokenizer {record['tokenizer_s']} s, "
          f"init {record['init_s']} s, save {record['save_s']} s); peak RSS {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
