"""The one place that touches transformers (and TRL) internals: optimizer names, callback frames, TRL metrics.

transformers has no public registry of optimizers: names are members of the ``OptimizerNames`` enum in
``transformers.training_args`` (``TrainingArguments.__post_init__`` converts ``optim`` with it, and
``HfArgumentParser`` lists its values as ``--optim`` choices), and each name's factory is an entry of
``_OPTIMIZER_HANDLERS`` in ``transformers.trainer_optimizer``. ``optim_args`` are checked by wrapping
``TrainingArguments.__post_init__`` and ``TrainingArguments.set_optimizer``. A callback's handler is found in
the frame of ``CallbackHandler.call_event``, and the trainer running a callback in the frame of the loop that
called it. Resuming replaces ``Trainer._load_optimizer_and_scheduler`` for our optimizers, to load their
state to the CPU, and wraps ``Trainer._load_callback_state`` so that our callbacks keep their instance.
``Trainer._save`` is wrapped so that ``save_on_each_node`` writes the model's weights on every node, and
``Trainer._save_checkpoint`` so that a checkpoint takes its name only once it is written whole (its writers,
``TrainerState.save_to_json`` and ``_push_from_checkpoint`` are redirected for the time of a save).
TRL's trainers keep metrics per micro-batch in ``_metrics`` and ``_total_train_tokens``, which a replayed
micro-batch must not count twice. All are used here and nowhere else;
``tests/test_transformers_internals.py`` fails loudly when a release changes them.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch


class RegistrationError(RuntimeError):
    """transformers' optimizer tables are not where this module expects them."""


def _fail(
    expected: str,
    action: str = "register hf-paged optimizers",
    instead: str = "pass the optimizer to the Trainer with Trainer(optimizers=(optimizer, None)) instead",
) -> RegistrationError:
    version = importlib.import_module("transformers").__version__
    return RegistrationError(f"cannot {action} with transformers {version}: expected {expected}; {instead}")


def _optimizer_names() -> type:
    names = getattr(importlib.import_module("transformers.training_args"), "OptimizerNames", None)
    if names is None or not all(
        hasattr(names, table) for table in ("_member_map_", "_member_names_", "_value2member_map_")
    ):
        raise _fail("the OptimizerNames enum in transformers.training_args")
    return names


def _optimizer_handlers() -> dict[Any, Callable[..., Any]]:
    handlers = getattr(importlib.import_module("transformers.trainer_optimizer"), "_OPTIMIZER_HANDLERS", None)
    if not isinstance(handlers, dict):
        raise _fail("the _OPTIMIZER_HANDLERS dict in transformers.trainer_optimizer")
    return handlers


def add_optimizer_name(value: str) -> Any:
    """Add ``value`` to ``OptimizerNames`` (member name ``value.upper()``) unless it is there; return the member."""
    names = _optimizer_names()
    if value in names._value2member_map_:
        return names._value2member_map_[value]
    member_name = value.upper()
    member = str.__new__(names, value)
    member._name_ = member_name
    member._value_ = value
    member.__objclass__ = names
    member._sort_order_ = len(names._member_names_)
    if hasattr(names, "_add_member_"):
        names._add_member_(member_name, member)
    else:
        names._member_map_[member_name] = member
        type.__setattr__(names, member_name, member)
    if member_name not in names._member_names_:
        names._member_names_.append(member_name)
    names._value2member_map_[value] = member
    return member


def set_optimizer_handler(value: str, handler: Callable[..., Any]) -> None:
    """Make the Trainer build optimizer ``value`` with ``handler(context) -> (optimizer_class, kwargs)``."""
    _optimizer_handlers()[_optimizer_names()(value)] = handler


def optimizer_handler(value: str) -> Callable[..., Any] | None:
    """The handler the Trainer uses for optimizer ``value``, if any."""
    names = _optimizer_names()
    return _optimizer_handlers().get(names(value)) if value in names._value2member_map_ else None


def check_training_arguments_with(check: Callable[[Any], None]) -> None:
    """Call ``check(args)`` at the end of ``TrainingArguments.__post_init__`` and ``set_optimizer`` (idempotent);
    when it raises, the arguments are put back as they were before the call.

    The dataclass ``__init__`` calls ``__post_init__``, so every way of building the arguments is checked:
    ``TrainingArguments(...)``, ``HfArgumentParser``, and subclasses such as TRL's ``SFTConfig``.
    """
    arguments = getattr(importlib.import_module("transformers.training_args"), "TrainingArguments", None)
    for method_name in ("__post_init__", "set_optimizer"):
        method = getattr(arguments, method_name, None)
        if not callable(method):
            raise _fail(f"TrainingArguments.{method_name}")
        if getattr(method, "_hf_paged_check", None) is not None:
            continue
        setattr(arguments, method_name, _followed_by(method, check))


def _followed_by(method: Callable[..., Any], check: Callable[[Any], None]) -> Callable[..., Any]:
    @functools.wraps(method)
    def checked(self, *args: Any, **kwargs: Any) -> Any:
        before = dict(vars(self))
        result = method(self, *args, **kwargs)
        try:
            check(self)
        except ValueError:
            vars(self).clear()
            vars(self).update(before)
            raise
        return result

    checked._hf_paged_check = check
    return checked


def calling_callback_handler(max_depth: int = 4) -> Any | None:
    """The ``CallbackHandler`` whose ``call_event`` is running the caller's event method, if one is.

    Callbacks are not given their handler; a callback that must reorder itself among the others (to run
    before the ``report_to`` integrations) finds it in the ``call_event`` frame that called it.
    """
    from transformers.trainer_callback import CallbackHandler

    return _self_in_calling_frames(CallbackHandler, max_depth)


_TRAINER_LOAD_NAMES = (
    "OPTIMIZER_NAME",
    "SCHEDULER_NAME",
    "check_torch_load_is_safe",
    "reissue_pt_warnings",
    "is_torch_xla_available",
    "is_sagemaker_mp_enabled",
)
"""What the replacement of ``Trainer._load_optimizer_and_scheduler`` uses from ``transformers.trainer``."""


def load_optimizer_state_on_cpu(is_ours: Callable[[Any], bool]) -> None:
    """Make the Trainer load a checkpoint's optimizer state to the CPU when ``is_ours(trainer.optimizer)``.

    ``Trainer._load_optimizer_and_scheduler`` loads ``optimizer.pt`` with ``map_location=args.device`` when
    ``args.world_size > 1``: the whole state on the accelerator before ``load_state_dict`` copies it back
    to the host, which is the memory a paged optimizer lacks. For a plain checkpoint (no DeepSpeed, FSDP,
    XLA or SageMaker) this loads it with ``map_location="cpu"``, and the scheduler as the Trainer does;
    every other case, and other optimizers, keep the Trainer's own method. Idempotent.
    """
    module = importlib.import_module("transformers.trainer")
    trainer_cls = getattr(module, "Trainer", None)
    original = getattr(trainer_cls, "_load_optimizer_and_scheduler", None)
    if getattr(original, "hf_paged_original", None) is not None:
        return
    if original is None or not all(hasattr(module, name) for name in _TRAINER_LOAD_NAMES):
        raise _fail(
            "Trainer._load_optimizer_and_scheduler and " + ", ".join(_TRAINER_LOAD_NAMES) + " in transformers.trainer",
            action="make the Trainer resume hf-paged optimizers from the CPU",
            instead="load the checkpoint's optimizer.pt with map_location='cpu' and call optimizer.load_state_dict",
        )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        special = any(getattr(self, flag, True) for flag in ("is_deepspeed_enabled", "is_fsdp_enabled"))
        special = special or module.is_torch_xla_available() or module.is_sagemaker_mp_enabled()
        if checkpoint is None or special or not is_ours(self.optimizer):
            return original(self, checkpoint)
        optimizer_file = os.path.join(checkpoint, module.OPTIMIZER_NAME)
        scheduler_file = os.path.join(checkpoint, module.SCHEDULER_NAME)
        if not (os.path.isfile(optimizer_file) and os.path.isfile(scheduler_file)):
            return original(self, checkpoint)
        module.check_torch_load_is_safe()
        self.optimizer.load_state_dict(torch.load(optimizer_file, map_location="cpu", weights_only=True))
        with warnings.catch_warnings(record=True) as caught_warnings:
            module.check_torch_load_is_safe()
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
        module.reissue_pt_warnings(caught_warnings)

    _load_optimizer_and_scheduler.hf_paged_original = original
    _load_optimizer_and_scheduler.__doc__ = original.__doc__
    trainer_cls._load_optimizer_and_scheduler = _load_optimizer_and_scheduler


def restore_callback_states_in_place(keeps_instance: Callable[[Any], bool]) -> None:
    """Make the Trainer hand a checkpoint's saved state to ``callback.load_state`` for each callback for which
    ``keeps_instance(callback)`` holds, instead of replacing that callback (idempotent).

    With ``restore_callback_states_from_checkpoint=True``, ``Trainer._load_callback_state`` builds a new
    callback from each saved state (``type(callback)(**args)``, then ``setattr`` of its attributes) and removes
    the one it was given, which then hears no more events while the user still holds it. The callbacks kept
    here stay where they are and load the saved state; the others are restored as the Trainer does.
    """
    module = importlib.import_module("transformers.trainer")
    trainer_cls = getattr(module, "Trainer", None)
    original = getattr(trainer_cls, "_load_callback_state", None)
    if getattr(original, "hf_paged_original", None) is not None:
        return
    if original is None:
        raise _fail(
            "Trainer._load_callback_state",
            action="restore MemorySpikeCallback's state in the callback the Trainer was given",
            instead="resume with restore_callback_states_from_checkpoint=False (the callback reads its timeline back)",
        )

    def _load_callback_state(self) -> None:
        saved = self.state.stateful_callbacks
        kept: dict[str, list[Any]] = {}
        if self.args.restore_callback_states_from_checkpoint:
            for callback in self.callback_handler.callbacks:
                if type(callback).__name__ in saved and keeps_instance(callback):
                    kept.setdefault(type(callback).__name__, []).append(callback)
        self.state.stateful_callbacks = {name: data for name, data in saved.items() if name not in kept}
        try:
            original(self)
        finally:
            self.state.stateful_callbacks = saved
        for name, callbacks in kept.items():
            states = saved[name] if isinstance(saved[name], list) else [saved[name]]
            for callback, state in zip(callbacks, states):
                callback.load_state(state)

    _load_callback_state.hf_paged_original = original
    _load_callback_state.__doc__ = original.__doc__
    trainer_cls._load_callback_state = _load_callback_state


def save_weights_on_each_node() -> None:
    """Make the Trainer write the model's weights on every node's first process with ``save_on_each_node``
    (idempotent).

    ``Trainer._save`` calls ``save_pretrained(is_main_process=args.should_save)``, which that setting makes true on
    each node's first process, but ``PreTrainedModel.should_save_on_this_rank`` (transformers 5) also requires
    global rank 0: the other nodes' checkpoints get the optimizer, scheduler and trainer state but no weights, and
    resuming there fails ("Can't find a valid checkpoint"). Within ``Trainer._save`` of a model that transformers
    did not shard itself, the Trainer's choice of writer then decides; everything else is unchanged.
    """
    module = importlib.import_module("transformers.trainer")
    trainer_cls = getattr(module, "Trainer", None)
    original = getattr(trainer_cls, "_save", None)
    if getattr(original, "hf_paged_original", None) is not None:
        return
    if original is None:
        raise _fail(
            "Trainer._save",
            action="write the model's weights on every node with save_on_each_node",
            instead="train with the output directory on storage all nodes share, save_on_each_node off",
        )

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        args = self.args
        other_node = args.save_on_each_node and args.should_save and args.process_index != 0
        if not other_node or getattr(self, "is_distributed_loading_by_transformers", False):
            return original(self, output_dir, state_dict=state_dict)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        model.should_save_on_this_rank = lambda is_main_process: is_main_process
        try:
            return original(self, output_dir, state_dict=state_dict)
        finally:
            del model.should_save_on_this_rank

    _save.hf_paged_original = original
    _save.__doc__ = original.__doc__
    trainer_cls._save = _save


PARTIAL_PREFIX = "_partial-"
"""What the folder of a checkpoint being written is called before its name: ``_partial-checkpoint-200``. Neither
``get_last_checkpoint``, ``resume_from_checkpoint=True``, the rotation of checkpoints nor a push to the Hub takes it."""

_CHECKPOINT_WRITERS = ("save_model", "_save_optimizer_and_scheduler", "_save_scaler", "_save_rng_state")
"""The Trainer's methods that ``Trainer._save_checkpoint`` gives the checkpoint's folder to write in."""


def write_checkpoints_whole(applies: Callable[[Any], bool]) -> None:
    """Make the Trainer write a checkpoint of a trainer for which ``applies(trainer)`` holds into
    ``_partial-checkpoint-N`` and rename it ``checkpoint-N`` once every process has written its part (idempotent).

    ``Trainer._save_checkpoint`` writes into ``checkpoint-N`` directly, and every process writes its part (its RNG
    state, its shards) on its own: a process that ends during a save (an error, SIGTERM, SIGKILL) leaves a folder that
    ``get_last_checkpoint`` and ``resume_from_checkpoint=True`` take and the Trainer cannot load. Here the processes
    meet after writing (a barrier); the process that writes the Trainer's state (``args.should_save``: the first, or
    the first of each node with ``save_on_each_node``) renames the folder (atomic), then rotates the checkpoints, and
    the first process pushes to the Hub, as the Trainer does; partial folders that an earlier save left are removed
    before writing. A ``checkpoint-N`` that exists already (written again, or begun by a subclass) gets the files.
    """
    module = importlib.import_module("transformers.trainer")
    trainer_cls = getattr(module, "Trainer", None)
    original = getattr(trainer_cls, "_save_checkpoint", None)
    if getattr(original, "hf_paged_original", None) is not None:
        return
    methods = (*_CHECKPOINT_WRITERS, "_push_from_checkpoint", "_get_output_dir")
    if (
        original is None
        or not all(hasattr(trainer_cls, name) for name in methods)
        or not all(hasattr(module, name) for name in ("PREFIX_CHECKPOINT_DIR", "rotate_checkpoints"))
    ):
        raise _fail(
            "Trainer._save_checkpoint, "
            + ", ".join(f"Trainer.{name}" for name in methods)
            + ", PREFIX_CHECKPOINT_DIR and rotate_checkpoints in transformers.trainer",
            action="write checkpoints whole",
            instead="resume from a checkpoint that holds trainer_state.json",
        )

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if not applies(self):
            return original(self, model, trial)
        run_dir = self._get_output_dir(trial=trial)
        final = os.path.join(run_dir, f"{module.PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        partial = os.path.join(run_dir, PARTIAL_PREFIX + os.path.basename(final))
        if self.args.should_save:
            for left in glob.glob(os.path.join(glob.escape(run_dir), PARTIAL_PREFIX + "*")):
                shutil.rmtree(left, ignore_errors=True)
        self.accelerator.wait_for_everyone()  # no process writes into a folder being removed
        if self.args.save_strategy != "no" and self.state.best_global_step == self.state.global_step:
            self.state.best_model_checkpoint = final  # the Trainer sets it where the folder exists: not yet, here
        pushes: list[str] = []
        with _writing_into(self, final, partial, pushes):
            original(self, model, trial)
        self.accelerator.wait_for_everyone()  # every process has written its part
        if self.args.should_save:
            _move(partial, final)
            module.rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()  # the checkpoint is whole for every process
        if pushes:
            self._push_from_checkpoint(final)

    _save_checkpoint.hf_paged_original = original
    _save_checkpoint.__doc__ = original.__doc__
    trainer_cls._save_checkpoint = _save_checkpoint


@contextlib.contextmanager
def _writing_into(trainer: Any, final: str, partial: str, pushes: list[str]) -> Iterator[None]:
    """Inside, the checkpoint's writers write into ``partial`` what they are given for ``final``, and its push to the
    Hub is kept in ``pushes`` for when the checkpoint has its name."""

    def redirected(write: Callable[..., Any]) -> Callable[..., Any]:
        def write_partial(path: str, *args: Any, **kwargs: Any) -> Any:
            if path == final or path.startswith(final + os.sep):
                path = partial + path[len(final) :]
            return write(path, *args, **kwargs)

        return write_partial

    writers = {name: redirected(getattr(trainer, name)) for name in _CHECKPOINT_WRITERS}
    with (
        _overriding(trainer, {**writers, "_push_from_checkpoint": pushes.append}),
        _overriding(trainer.state, {"save_to_json": redirected(trainer.state.save_to_json)}),
    ):
        yield


@contextlib.contextmanager
def _overriding(target: Any, attributes: dict[str, Any]) -> Iterator[None]:
    """Inside, ``target`` has ``attributes`` of its own; then those it had before, if any."""
    before = {name: vars(target)[name] for name in attributes if name in vars(target)}
    vars(target).update(attributes)
    try:
        yield
    finally:
        for name in attributes:
            if name in before:
                vars(target)[name] = before[name]
            else:
                del vars(target)[name]


def _move(partial: str, final: str) -> None:
    """Give ``partial`` the name ``final`` (atomic); where ``final`` exists, move ``partial``'s entries into it."""
    try:
        os.rename(partial, final)
        return
    except FileNotFoundError:  # another node's first process moved it (save_on_each_node on storage nodes share)
        return
    except OSError:
        if not os.path.isdir(final):
            raise
    for name in os.listdir(partial):
        target = os.path.join(final, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        os.replace(os.path.join(partial, name), target)
    os.rmdir(partial)


def around_checkpoint_saves(
    trainer: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Callable[[], None]:
    """Make ``trainer`` save each checkpoint through ``wrap(save)`` (``save``: its own ``_save_checkpoint``, which
    every save strategy calls); returns what undoes it."""
    own = vars(trainer).get("_save_checkpoint")
    trainer._save_checkpoint = wrap(trainer._save_checkpoint)

    def undo() -> None:
        if own is None:
            vars(trainer).pop("_save_checkpoint", None)
        else:
            trainer._save_checkpoint = own

    return undo


def calling_trainer(max_depth: int = 8) -> Any | None:
    """The ``Trainer`` whose training loop is running the caller's event method, if one is.

    Callbacks are not given their trainer; one that must wrap its training step (out-of-memory recovery)
    finds it in the frame of the loop (``Trainer._inner_training_loop``) that raised the event.
    """
    from transformers import Trainer

    return _self_in_calling_frames(Trainer, max_depth)


def _self_in_calling_frames(cls: type, max_depth: int) -> Any | None:
    """The first ``self`` that is a ``cls``, in the ``max_depth`` frames above the event method that asked."""
    frame = sys._getframe(3)  # past this function, the finder that called it and the event method that asked
    for _ in range(max_depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, cls):
            return candidate
        frame = frame.f_back
    return None


def _train_metrics(trainer: Any) -> dict[str, list] | None:
    """TRL's per-micro-batch training metrics (``trainer._metrics["train"]``), ``None`` for other trainers."""
    metrics = getattr(trainer, "_metrics", None)
    if metrics is None:
        return None
    train = metrics.get("train") if isinstance(metrics, dict) else None
    if not isinstance(train, dict) or not all(isinstance(values, list) for values in train.values()):
        raise TypeError(f"expected {type(trainer).__name__}._metrics to map 'train' to lists, got {metrics!r}")
    return train


def trainer_metric_marks(trainer: Any) -> dict[str, Any]:
    """What :func:`rewind_trainer_metrics` needs to undo the metrics of the micro-batches to come."""
    train = _train_metrics(trainer)
    if train is None:
        return {}
    return {
        "metrics": {key: list(values) for key, values in train.items()},
        "total_train_tokens": getattr(trainer, "_total_train_tokens", None),
    }


def rewind_trainer_metrics(trainer: Any, marks: dict[str, Any]) -> None:
    """Put the trainer's per-micro-batch metrics back as :func:`trainer_metric_marks` found them."""
    if not marks:
        return
    train = _train_metrics(trainer)
    for key in [key for key in train if key not in marks["metrics"]]:
        del train[key]
    for key, values in marks["metrics"].items():
        train[key] = list(values)
    if marks["total_train_tokens"] is not None:
        trainer._total_train_tokens = marks["total_train_tokens"]
