"""A training script that knows nothing of hf_paged: it parses TrainingArguments and trains a tiny model."""

import json

from transformers import HfArgumentParser, Trainer, TrainingArguments

from trainer_utils import tiny_llama, token_dataset

if __name__ == "__main__":
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    args.use_cpu, args.report_to, args.disable_tqdm = True, [], True
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset())
    trainer.train()
    print(json.dumps({"optimizer": type(trainer.optimizer.optimizer).__name__}))
