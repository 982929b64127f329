"""QLoRA fine-tuning with TRL's SFTTrainer, hf-paged's paged 8-bit AdamW and the memory timeline.

    python examples/train_sft.py                          # a tiny Llama built from a config: runs offline
    python examples/train_sft.py --model Qwen/Qwen2.5-0.5B --data train.jsonl --max-steps 200

Same arguments, data and outputs as ``train_trainer.py`` (whose helpers it uses); the records become TRL
prompt/completion examples, so the loss covers the responses only.
"""

from __future__ import annotations

import logging

import torch
from datasets import Dataset
from hf_paged.callbacks import MemorySpikeCallback
from train_trainer import PROMPT, model_and_tokenizer, parse_args, read_records
from trl import SFTConfig, SFTTrainer


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = parse_args(__doc__.splitlines()[0], argv)
    model, tokenizer = model_and_tokenizer(args.model)
    records = read_records(args.data)
    dataset = Dataset.from_list(
        [{"prompt": PROMPT.format(instruction=r["instruction"]), "completion": r["response"]} for r in records]
    )
    config = SFTConfig(
        output_dir=str(args.output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        learning_rate=2e-3 if args.model == "tiny" else 2e-4,
        optim="hf_paged_adamw_8bit",
        max_length=256,
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[MemorySpikeCallback()],
    )
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
