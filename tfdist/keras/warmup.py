"""The learning-rate warm-up of ``dist.callbacks(warmup_epochs=...)``, for every Keras: the body
of :class:`tfdist.keras.callbacks.LearningRateWarmup` (TensorFlow's Keras) and of Keras 3 on
JAX's (:mod:`tfdist.jax.callbacks`), each of which adds its Keras's ``Callback`` as the second
base. It imports neither TensorFlow nor Keras.

Goyal et al. (2017): with linear scaling by the number of replicas, start at the
single-replica rate and reach the scaled rate after ``warmup_epochs`` epochs. The rate is set
before a step only when it changes, so that after the warm-up a rate set by another callback
(``ReduceLROnPlateau``) stands, and Keras 3 on JAX, whose ``fit`` keeps the variables' values
aside between steps, writes them back (which reading ``self.model`` does) only then.
"""

from __future__ import annotations

from typing import Any

from tfdist.errors import ConfigError

__all__ = ["Warmup"]


class Warmup:
    """Ramps the learning rate from ``lr / size`` up to the (scaled) ``lr`` the optimizer has.

    Args:
        warmup_epochs: epochs to reach the optimizer's rate (a fraction counts by steps).
        size: replicas: the rate starts at the optimizer's divided by it.
    """

    model: Any  # set by Keras (its Callback, the other base)
    params: dict[str, Any]

    def __init__(self, warmup_epochs: float, size: int) -> None:
        super().__init__()
        self.warmup_epochs, self.size = warmup_epochs, size
        self.target: float | None = None
        self._epoch = 0
        self._rate: float | None = None  # the rate this callback set last

    def on_train_begin(self, logs: Any = None) -> None:
        optimizer = self.model.optimizer
        schedule = getattr(optimizer, "_learning_rate", None)
        if any(cls.__name__ == "LearningRateSchedule" for cls in type(schedule).__mro__):
            # It sets the rate every step: Keras 3 fails on the rate it returns, tf_keras
            # overwrites the warmup's. The same answer on every rank, before any step.
            raise ConfigError(
                f"dist.callbacks(warmup_epochs=...) ramps a constant learning rate, but this "
                f"optimizer's is a {type(schedule).__name__} schedule, which sets the rate every "
                "step. Put the warmup in the schedule (keras.optimizers.schedules.CosineDecay's "
                "warmup_steps and warmup_target) and drop warmup_epochs")
        self.target = self.read(optimizer.learning_rate)
        self._rate = None

    def read(self, rate: Any) -> float:
        """The value of the optimizer's ``learning_rate`` (a Keras may read it otherwise)."""
        return float(rate)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch
        if not self.params.get("steps"):
            self._set(epoch)  # steps per epoch unknown: warm up once per epoch

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        steps = self.params.get("steps")
        if steps:
            self._set(self._epoch + batch / steps)

    def _set(self, progress_epochs: float) -> None:
        assert self.target is not None
        fraction = min(1.0, progress_epochs / self.warmup_epochs) if self.warmup_epochs else 1.0
        start = self.target / self.size
        rate = start + (self.target - start) * fraction
        if rate != self._rate:
            self._rate = rate
            self.model.optimizer.learning_rate.assign(rate)
