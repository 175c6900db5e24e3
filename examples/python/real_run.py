"""A real run of a family other than the Llama (issue 47): Qwen3-MoE on real English text
with its own tokenizer, trained by Bonfire's `train`, its export read back by transformers.

    python examples/python/real_run.py prepare OUT       # corpus, tokenizer, config
    cargo run --release --example train -- --model OUT/model ... --export OUT/export
    python examples/python/real_run.py check OUT         # transformers reads the export

`prepare` writes into OUT:
- `train/*.txt`, `valid.txt`: Vim's user manual as this machine's Debian package ships it
  (`/usr/share/vim/vim90/doc/usr_*.txt`, 36 chapters of prose, 642 KB): every chapter but the
  last two to train on, those two held out;
- `model/tokenizer.json`: a byte-level BPE of 2,048 tokens trained on `train/` with Hugging
  Face `tokenizers` (what a Qwen tokenizer is, smaller);
- `model/config.json`: a Qwen3-MoE (`model_type: qwen3_moe`) of hidden 128, 4 layers, 4 heads
  of 32 over 2 kv heads, 8 experts of width 128, top 2 renormalized, 128 positions (no
  weights: `train` starts from its seeded init).

`check` loads `OUT/export` with `AutoModelForCausalLM.from_pretrained` (no missing or
unexpected key), tokenizes `valid.txt` with `OUT/model/tokenizer.json`, and prints the mean
cross-entropy of its consecutive 128-token windows (`valid_ce=…`), the figure Bonfire's eval
loss reports as cross-entropy plus α·balance.
"""

import json
import pathlib
import shutil
import sys

CHAPTERS = sorted(pathlib.Path("/usr/share/vim/vim90/doc").glob("usr_*.txt"))
SEQ, VOCAB = 128, 2048


def prepare(out):
    if len(CHAPTERS) < 3:
        sys.exit("the Vim user manual (/usr/share/vim/vim90/doc/usr_*.txt) is not here")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    (out / "train").mkdir(parents=True, exist_ok=True)
    (out / "model").mkdir(parents=True, exist_ok=True)
    for c in CHAPTERS[:-2]:
        shutil.copy(c, out / "train" / c.name)
    (out / "valid.txt").write_text("".join(c.read_text() for c in CHAPTERS[-2:]))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
    )
    tok.train([str(p) for p in sorted((out / "train").glob("*.txt"))], trainer)
    tok.save(str(out / "model" / "tokenizer.json"))
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": SEQ,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.01,
        "output_router_logits": True,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    }
    (out / "model" / "config.json").write_text(json.dumps(config, indent=2))
    print(f"prepared {out}: {len(CHAPTERS) - 2} chapters to train on, 2 held out")


def check(out):
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        out / "export", output_loading_info=True, dtype=torch.float32
    )
    bad = {k: v for k, v in info.items() if v}
    ids = Tokenizer.from_file(str(out / "model" / "tokenizer.json"))
    ids = ids.encode((out / "valid.txt").read_text()).ids
    windows = torch.tensor(ids[: len(ids) // (SEQ + 1) * (SEQ + 1)]).reshape(-1, SEQ + 1)
    losses = []
    with torch.no_grad():
        for batch in windows.split(16):
            logits = model(input_ids=batch[:, :-1]).logits
            ce = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
            )
            losses.append((ce.item(), len(batch)))
    ce = sum(l * n for l, n in losses) / sum(n for _, n in losses)
    print(f"keys_ok={not bad} class={type(model).__name__} windows={len(windows)} valid_ce={ce:.4f}")
    return 0 if not bad else 1


if __name__ == "__main__":
    cmd, out = sys.argv[1], pathlib.Path(sys.argv[2])
    sys.exit(prepare(out) if cmd == "prepare" else check(out))
