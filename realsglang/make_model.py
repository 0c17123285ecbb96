"""Write a tiny random-weight Llama model directory for real SGLang on a CPU (setup.sh runs it).

Usage: python make_model.py DIR. Two layers, hidden size 128, and a byte-level BPE tokenizer
trained here on a fixed sentence: nothing comes from a model hub. The servers start it with
`--load-format dummy` (random weights), so the directory holds only configs and the tokenizer.
Runs with the sglang venv's python (it has `tokenizers`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # type: ignore[import-not-found]

VOCAB_SIZE = 320
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
CORPUS = ["The quick brown fox jumps over the lazy dog. Hello world, this is a test."] * 50


def train_tokenizer(out: Path) -> int:
    """A byte-level BPE tokenizer in out/tokenizer.json; returns its vocabulary size."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    return int(tokenizer.get_vocab_size())


def llama_config(vocab_size: int) -> dict[str, Any]:
    """config.json of the tiny Llama (ids 0/1/2: the special tokens, trained first)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }


def write_model(out: Path) -> None:
    """Every file of the model directory."""
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = train_tokenizer(out)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **SPECIAL,
        "model_max_length": 4096,
        "add_bos_token": False,
    }
    files = {
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": SPECIAL,
        "config.json": llama_config(vocab_size),
        "generation_config.json": {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2},
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=1))


if __name__ == "__main__":
    write_model(Path(sys.argv[1] if len(sys.argv) > 1 else "model"))
