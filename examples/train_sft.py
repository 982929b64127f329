"""QLoRA fine-tuning with TRL's SFTTrainer, hf-paged's paged 8-bit AdamW and the memory timeline.

    pip install -e ".[examples]"
    python examples/train_sft.py                          # a tiny Llama built from a config: runs offline
    python examples/train_sft.py --model Qwen/Qwen2.5-0.5B --data train.jsonl --max-steps 200

Same arguments, data and outputs as ``train_trainer.py`` (whose helpers it uses), written to
``examples-output/train_sft`` by default; the records become TRL prompt/completion examples, so the loss covers
the responses only.
"""

from __future__ import annotations

import logging

from hf_paged.cli import quiet

quiet.install()  # first, as in train_trainer.py: before the libraries below are imported

import torch  # noqa: E402
from datasets import Dataset, disable_progress_bars, enable_progress_bars  # noqa: E402
from train_trainer import OUTPUT_ROOT, PROMPT, model_and_tokenizer, parse_args, read_records, say_where  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from hf_paged.callbacks import MemorySpikeCallback  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = parse_args(__doc__.splitlines()[0], OUTPUT_ROOT / "train_sft", argv)
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
        # prepare_qlora has already turned on (non-reentrant) activation checkpointing; TRL's default would turn
        # it on again, through the name transformers deprecates (gradient_checkpointing)
        activation_checkpointing=False,
        dataloader_pin_memory=torch.cuda.is_available(),  # pinned batches only help a copy to a GPU
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    # TRL prepares the examples in five passes (EOS, tokenizing, labels, truncating, dropping fully masked ones),
    # each with a progress bar of its own; over examples already in memory they take no time worth drawing
    disable_progress_bars()
    try:
        trainer = SFTTrainer(
            model=model,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[MemorySpikeCallback()],
        )
    finally:
        enable_progress_bars()
    trainer.train()
    trainer.save_model()
    say_where(args.output_dir)


if __name__ == "__main__":
    main()
