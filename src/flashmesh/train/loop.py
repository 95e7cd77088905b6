"""The training loop: one jitted step (loss, gradients, AdamW with warm-up and cosine decay,
the FP8 state threaded through), a validation loss every `eval_every` steps, rich progress.

Precision 'bf16' trains with bf16 activations (float32 parameters and optimizer state).
Precision 'fp8' runs the same under `flashmesh.te.autocast(enabled=True, recipe=...)`:
the model is initialised inside it, so its modules create an `fp8_metas` collection, and every
step traces inside it, so their GEMMs run in FP8. TransformerEngine's convention carries the
FP8 state: the step differentiates the loss with respect to all variables, the optimizer
updates `params` from their gradients only, and `flashmesh.quantization.update_fp8_metas`
writes the `fp8_metas` cotangents (the new scales and amax histories) over the state.

Both precisions draw the same training batches and the same initial parameters from one seed,
and score the same fixed validation windows, so their curves differ by the precision alone.

Shapes: B batch, T sequence length.

Example:
  >>> corpus = data.load_corpus()
  >>> curves = train(gpt.GPTConfig(layers=2, hidden=128, seq=64), TrainConfig(steps=100, batch=8),
  ...                corpus, precision="bf16")
  >>> curves.val_loss[-1]
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import jax
import numpy as np
import optax

from flashmesh.train import data, gpt

PRECISIONS = ("bf16", "fp8")
FP8_COLLECTION = "fp8_metas"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How the model is trained.

    steps: optimizer steps; batch: windows per step (each config.seq + 1 bytes).
    lr: peak learning rate, reached linearly over `warmup` steps, then cosine decay to
      lr * min_lr_ratio at the last step.
    weight_decay: AdamW's decoupled decay, applied to matrices (kernels, embeddings) only.
    b1, b2: Adam's moment decays; clip: global gradient-norm clip.
    eval_every: validation loss every this many steps (and before the first, and after the last).
    eval_batches: fixed validation batches (of `batch` windows) averaged per evaluation.
    seed: parameters, training batches, validation windows and dropout all derive from it.
    amax_history_len: FP8 DelayedScaling's amax history length ('max' over it).
    """

    steps: int = 1500
    batch: int = 64
    lr: float = 1e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    seed: int = 0
    amax_history_len: int = 16

    def __post_init__(self):
        for name in ("steps", "batch", "eval_every", "eval_batches", "amax_history_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.warmup, int) or not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup must be an int in [0, steps={self.steps}), got {self.warmup!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")


@dataclasses.dataclass(frozen=True)
class Curves:
    """What one run returns: its loss curves and timings (nats per byte).

    steps, train_loss: the training loss of every step (step 1 is the first update).
    val_steps, val_loss: the validation loss after that many steps (0: at initialisation).
    seconds: the loop's wall time (without compilation); train_seconds: that without the
    evaluations; compile_seconds: compiling the step and the evaluation.
    status: 'ok', or why the run stopped early (a non-finite loss).
    """

    precision: str
    steps: tuple[int, ...]
    train_loss: tuple[float, ...]
    val_steps: tuple[int, ...]
    val_loss: tuple[float, ...]
    seconds: float
    train_seconds: float
    compile_seconds: float
    tokens_per_step: int
    params: int
    status: str = "ok"

    @property
    def final_val_loss(self) -> float:
        return self.val_loss[-1]

    @property
    def final_train_loss(self) -> float:
        """Mean training loss over the last 5 % of the steps (at least one): less noisy than one."""
        tail = self.train_loss[-max(1, len(self.train_loss) // 20):]
        return float(np.mean(tail))

    @property
    def tokens_per_second(self) -> float:
        return len(self.steps) * self.tokens_per_step / self.train_seconds if self.train_seconds > 0 else math.nan

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), final_val_loss=self.final_val_loss,
                    final_train_loss=self.final_train_loss, tokens_per_second=self.tokens_per_second)


# -- pieces -----------------------------------------------------------------------------------------
def optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on a warm-up + cosine schedule (decay on matrices only)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.lr, warmup_steps=config.warmup, decay_steps=config.steps,
        end_value=config.lr * config.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    tx = optax.chain(optax.clip_by_global_norm(config.clip),
                     optax.adamw(schedule, b1=config.b1, b2=config.b2,
                                 weight_decay=config.weight_decay, mask=decay_mask))

    # optax's own arithmetic mixes its int32 step count with Python floats (Adam's bias
    # correction b ** count), which strict dtype promotion refuses; it runs under the standard
    # rules, the model and the loss under whatever the caller set.
    def init(params):
        with jax.numpy_dtype_promotion("standard"):
            return tx.init(params)

    def update(updates, state, params=None):
        with jax.numpy_dtype_promotion("standard"):
            return tx.update(updates, state, params)

    return optax.GradientTransformation(init, update)


def precision_context(precision: str, config: TrainConfig):
    """The context a run's init and steps trace in: nothing for bf16, FP8 autocast for fp8."""
    if precision == "bf16":
        return contextlib.nullcontext()
    if precision == "fp8":
        import flashmesh.te as te

        recipe = te.recipe.DelayedScaling(fp8_format=te.recipe.Format.HYBRID, amax_compute_algo="max",
                                          amax_history_len=config.amax_history_len)
        return te.autocast(enabled=True, recipe=recipe)
    raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def check_collections(variables: dict, fp8: bool) -> dict:
    """The variables the step threads: `params` and, under FP8, `fp8_metas`.

    The parameters come unboxed (`flax.linen.unbox`: init boxes them with their logical axes,
    for sharding rules; this loop runs on one device). Any other collection is refused, since
    the step would not know how to carry it.
    """
    from flax import linen as nn

    variables = dict(nn.unbox(variables))
    expected = {"params", FP8_COLLECTION} if fp8 else {"params"}
    if fp8 and FP8_COLLECTION not in variables:
        raise ValueError(f"the FP8 run's model created no {FP8_COLLECTION!r} collection (got "
                         f"{sorted(variables)}): its GEMMs would not be quantised")
    if set(variables) - expected:
        raise NotImplementedError(f"the training loop threads only {sorted(expected)}; the model "
                                  f"also has {sorted(set(variables) - expected)}")
    return variables


def make_train_step(model, tx: optax.GradientTransformation, fp8: bool):
    """step(variables, opt_state, x [B, T], y [B, T], key) -> (variables, opt_state, loss).

    The gradient is taken with respect to every variable; `params` move by the optimizer's
    update of their gradients, and under FP8 the `fp8_metas` cotangents replace the FP8 state
    (`flashmesh.quantization.update_fp8_metas`). Not jitted here (the caller compiles it).
    """
    update_fp8_metas = None
    if fp8:
        from flashmesh import quantization

        update_fp8_metas = quantization.update_fp8_metas

    def loss_fn(variables, x, y, key):
        logits = model.apply(variables, x, deterministic=False, rngs={"dropout": key})
        return gpt.next_byte_loss(logits, y)

    def step(variables, opt_state, x, y, key):
        loss, grads = jax.value_and_grad(loss_fn)(variables, x, y, key)
        updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
        params = optax.apply_updates(variables["params"], updates)
        if update_fp8_metas is not None:
            variables = update_fp8_metas(variables, grads)
        return {**variables, "params": params}, opt_state, loss

    return step


def make_eval_step(model):
    """loss(variables, x [B, T], y [B, T]) without dropout and without touching any state."""
    def evaluate(variables, x, y):
        return gpt.next_byte_loss(model.apply(variables, x, deterministic=True), y)

    return evaluate


# -- the loop ---------------------------------------------------------------------------------------
def train(model_config: gpt.GPTConfig, config: TrainConfig, corpus: data.Corpus, precision: str,
          progress: bool = True) -> Curves:
    """Train `gpt.GPT(model_config)` in `precision` ('bf16' or 'fp8'); returns its curves.

    Windows are `model_config.seq` bytes long. A non-finite training loss stops the run at the
    next evaluation; `Curves.status` then says where.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    model = gpt.GPT(model_config)
    seq, batch, fp8 = model_config.seq, config.batch, precision == "fp8"
    rng = np.random.default_rng([config.seed, 0])
    validation = data.validation_batches(corpus.validation, config.seed, config.eval_batches, batch, seq)
    key = jax.random.key(config.seed)
    init_key, dropout_key = jax.random.split(key)
    tx = optimizer(config)
    with precision_context(precision, config):
        x0, y0 = data.sample_batch(corpus.train, rng, batch, seq)
        variables = check_collections(
            jax.jit(lambda k, x: model.init({"params": k}, x, deterministic=True))(init_key, x0), fp8)
        opt_state = tx.init(variables["params"])
        started = time.perf_counter()
        step = jax.jit(make_train_step(model, tx, fp8), donate_argnums=(0, 1)).lower(
            variables, opt_state, x0, y0, dropout_key).compile()
        evaluate = jax.jit(make_eval_step(model)).lower(variables, *validation[0]).compile()
        compile_seconds = time.perf_counter() - started
        if not progress:  # a log's reader (a GPU run's output) sees where the run is
            print(f"train {precision}: compiled in {compile_seconds:.1f} s", flush=True)

        def validation_loss(variables) -> float:
            return float(np.mean(jax.device_get([evaluate(variables, x, y) for x, y in validation])))

        losses, val_steps, val_losses, status = [], [0], [validation_loss(variables)], "ok"
        eval_seconds, started = 0.0, time.perf_counter()
        with _progress(progress, config.steps, precision) as show:
            x, y = x0, y0
            for i in range(1, config.steps + 1):
                variables, opt_state, loss = step(variables, opt_state, x, y, jax.random.fold_in(dropout_key, i))
                losses.append(loss)
                if i < config.steps:
                    x, y = data.sample_batch(corpus.train, rng, batch, seq)  # while the device works
                if i % config.eval_every == 0 or i == config.steps:
                    losses = [float(v) for v in jax.device_get(losses)]
                    before = time.perf_counter()
                    val_steps.append(i)
                    val_losses.append(validation_loss(variables))
                    eval_seconds += time.perf_counter() - before
                    show(i, losses[-1], val_losses[-1])
                    if not all(math.isfinite(v) for v in losses[-config.eval_every:]):
                        status = f"stopped at step {i}: non-finite training loss"
                        break
                else:
                    show(i, None, None)
        seconds = time.perf_counter() - started
    return Curves(precision=precision, steps=tuple(range(1, len(losses) + 1)),
                  train_loss=tuple(float(v) for v in losses), val_steps=tuple(val_steps),
                  val_loss=tuple(val_losses), seconds=seconds, train_seconds=seconds - eval_seconds,
                  compile_seconds=compile_seconds, tokens_per_step=batch * seq,
                  params=gpt.count_params(variables["params"]), status=status)


@contextlib.contextmanager
def _progress(enabled: bool, total: int, precision: str):
    """show(step, train loss or None, validation loss or None) drives a rich progress bar; when
    disabled, each evaluation prints one plain line (for logs)."""
    if not enabled:
        started = time.perf_counter()

        def line(step, loss, val):
            if loss is not None:
                print(f"train {precision}: step {step}/{total}, train {loss:.4f}, val {val:.4f}, "
                      f"{time.perf_counter() - started:.0f} s", flush=True)

        yield line
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn(f"[bold]train {precision}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("{task.description}"))
    with bar:
        task = bar.add_task("", total=total)

        def show(step, loss, val):
            if loss is None:
                bar.update(task, completed=step)
            else:
                bar.update(task, completed=step, description=f"train {loss:.4f}  val {val:.4f}")

        yield show
