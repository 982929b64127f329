"""QLoRA fine-tuning with transformers' Trainer, hf-paged's paged 8-bit AdamW and the memory timeline.

    pip install -e ".[examples]"
    python examples/train_trainer.py                      # a tiny Llama built from a config: runs offline
    python examples/train_trainer.py --model Qwen/Qwen2.5-0.5B --data train.jsonl --max-steps 200

``--data`` is a JSON list or a JSON Lines file of ``{"instruction": ..., "response": ...}`` records (a few
built-in records without it). The adapter (``adapter_model.safetensors``) and the memory timeline
(``memory_timeline.jsonl``, ``memory_timeline.png``) are written to ``--output-dir``
(``examples-output/train_trainer``, which git ignores); the last line printed says where.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from hf_paged.cli import quiet

# First, as hf-paged train does: keeps out third-party lines a user cannot act on (optional kernels that fail to
# load, notices to other libraries' authors), which come as the libraries below are imported.
quiet.install()

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

from hf_paged.callbacks import MemorySpikeCallback  # noqa: E402
from hf_paged.qlora import prepare_qlora  # noqa: E402

BUILT_IN = [
    {"instruction": "Name a primary colour.", "response": "Red."},
    {"instruction": "What is two plus two?", "response": "Four."},
    {"instruction": "Give the opposite of hot.", "response": "Cold."},
    {"instruction": "Spell the word cat backwards.", "response": "tac"},
    {"instruction": "Which planet do we live on?", "response": "Earth."},
    {"instruction": "Say hello in French.", "response": "Bonjour."},
    {"instruction": "How many days are in a week?", "response": "Seven."},
    {"instruction": "What colour is the sky on a clear day?", "response": "Blue."},
]

PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"


OUTPUT_ROOT = Path("examples-output")
"""Where the examples write by default (relative to the working directory; git ignores it)."""


def parse_args(description: str, output_dir: Path, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="tiny", help="hub name or local path; 'tiny' builds a tiny Llama offline")
    parser.add_argument("--data", type=Path, help="JSON or JSON Lines file of instruction/response records")
    parser.add_argument("--output-dir", type=Path, default=output_dir, help=f"where to write (default {output_dir})")
    parser.add_argument("--max-steps", type=int, default=20)
    return parser.parse_args(argv)


def say_where(output_dir: Path) -> None:
    """Print where the adapter and the memory timeline went."""
    print(f"adapter and memory timeline written to {output_dir.resolve()}", flush=True)


def read_records(path: Path | None) -> list[dict[str, str]]:
    """The instruction/response records of a JSON list or JSON Lines file (the built-in ones for ``None``)."""
    if path is None:
        return BUILT_IN
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        records = json.loads(text)
    if not isinstance(records, list) or not records:
        raise ValueError(f"--data {path}: expected a non-empty list of records")
    for index, record in enumerate(records):
        if not isinstance(record, dict) or not all(isinstance(record.get(key), str) for key in ("instruction", "response")):
            raise ValueError(f"--data {path}: record {index} needs string fields 'instruction' and 'response'")
    return records


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built offline: one token per byte, plus <pad>, <s> and </s>."""
    specials = ["<pad>", "<s>", "</s>"]
    vocab = {token: index for index, token in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def model_and_tokenizer(name: str):
    """The QLoRA model (see ``hf_paged.qlora.prepare_qlora``) and its tokenizer."""
    if name == "tiny":
        tokenizer = byte_tokenizer()
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=256,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        return prepare_qlora(LlamaForCausalLM(config), r=8, lora_alpha=16), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return prepare_qlora(name), tokenizer


def tokenize(records: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase) -> list[dict[str, list[int]]]:
    texts = [PROMPT.format(instruction=r["instruction"]) + r["response"] + tokenizer.eos_token for r in records]
    return [{"input_ids": ids} for ids in tokenizer(texts, truncation=True, max_length=256)["input_ids"]]


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = parse_args(__doc__.splitlines()[0], OUTPUT_ROOT / "train_trainer", argv)
    model, tokenizer = model_and_tokenizer(args.model)
    training = TrainingArguments(
        output_dir=str(args.output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        learning_rate=2e-3 if args.model == "tiny" else 2e-4,
        optim="hf_paged_adamw_8bit",
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        dataloader_pin_memory=torch.cuda.is_available(),  # pinned batches only help a copy to a GPU
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=tokenize(read_records(args.data), tokenizer),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        callbacks=[MemorySpikeCallback()],
    )
    trainer.train()
    trainer.save_model()
    say_where(args.output_dir)


if __name__ == "__main__":
    main()
