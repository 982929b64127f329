"""A training script that knows nothing of hf_paged: it parses TrainingArguments and trains a tiny model.

It prints one JSON line per process: the optimizer class, the process's rank and a checksum of the
parameters after training.
"""

import json

import torch
from transformers import HfArgumentParser, Trainer, TrainingArguments

from trainer_utils import tiny_llama, token_dataset

if __name__ == "__main__":
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    args.use_cpu, args.report_to, args.disable_tqdm = True, [], True
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset())
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    params = torch.cat([param.detach().double().reshape(-1) for param in trainer.model.parameters()])
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    print(json.dumps({"optimizer": type(optimizer).__name__, "rank": args.process_index,
                      "checksum": params.sum().item(), "norm": params.norm().item()}))
