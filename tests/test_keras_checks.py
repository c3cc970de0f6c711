"""What tfdist checks of a Keras model before fit's first step (tfdist/keras/checks.py), on
real Keras objects in this process: a BatchNormalization model whose last batch would leave a
replica without rows is refused (its statistics, then every weight, would become NaN), and
every optimizer a model holds is checked, a GAN's two included."""

from __future__ import annotations

import logging

import pytest

from tfdist.errors import ConfigError

keras = pytest.importorskip("keras")


def _model(normalisation: keras.layers.Layer | None) -> keras.Model:
    layers = [keras.Input((4,)), keras.layers.Dense(8)]
    layers += [normalisation] if normalisation is not None else []
    return keras.Sequential([*layers, keras.layers.Dense(1)])


EMPTY_REPLICAS = {
    # name: (layer, rows in the last batch, replicas, refused)
    "a replica gets no rows": (keras.layers.BatchNormalization, 1, 2, True),
    "three of four get none": (keras.layers.BatchNormalization, 1, 4, True),
    "every replica gets a row": (keras.layers.BatchNormalization, 2, 2, False),
    "no short batch": (keras.layers.BatchNormalization, 0, 2, False),
    "not known": (keras.layers.BatchNormalization, None, 2, False),
    "one replica": (keras.layers.BatchNormalization, 1, 1, False),
    "no BatchNormalization": (None, 1, 2, False),
    "synchronised statistics": (lambda: keras.layers.BatchNormalization(synchronized=True),
                                1, 2, False),
}


@pytest.mark.parametrize("case", sorted(EMPTY_REPLICAS))
def test_batch_normalisation_on_an_empty_replica_is_refused_before_the_first_step(case):
    from tfdist.keras.checks import check_empty_replicas

    layer, rows, replicas, refused = EMPTY_REPLICAS[case]
    model = _model(layer() if layer is not None else None)
    if not refused:
        check_empty_replicas(model, rows, replicas)
        return
    with pytest.raises(ConfigError) as error:
        check_empty_replicas(model, rows, replicas)
    line = str(error.value)
    assert f"holds 1 row(s) for {replicas} replicas" in line, line
    assert f"{replicas - 1} of them get none" in line and "NaN" in line, line
    assert "drop_remainder=True" in line and "batch_normalization" in line, line


class _Gan(keras.Model):
    """The DCGAN example's shape: two optimizers passed to its own compile."""

    def __init__(self) -> None:
        super().__init__()
        self.generator, self.discriminator = _model(None), _model(None)

    def compile(self, d_optimizer, g_optimizer):  # type: ignore[no-untyped-def, override]
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer


def test_every_optimizer_a_model_holds_is_checked_and_each_clipping_one_named(caplog):
    from tfdist.keras.checks import check_optimizer
    from tfdist.keras.optimizers import optimizers

    gan = _Gan()
    d_optimizer = keras.optimizers.Adam(clipnorm=1.0, name="discriminator_adam")
    g_optimizer = keras.optimizers.Adam(clipvalue=0.5, name="generator_adam")
    gan.compile(d_optimizer, g_optimizer)
    found = optimizers(gan)
    assert [o for o in found if o is not gan.optimizer] == [d_optimizer, g_optimizer]
    compiled = _model(None)
    compiled.compile(optimizer=keras.optimizers.SGD(), loss="mse")
    assert optimizers(compiled) == [compiled.optimizer]
    with caplog.at_level(logging.WARNING, logger="tfdist"):
        for optimizer in [*found, *found]:  # fit twice: each named once
            check_optimizer(optimizer, is_chief=True)
    lines = [r.getMessage() for r in caplog.records if "clips each replica" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "discriminator_adam (clipnorm=1.0)" in lines[0], lines
    assert "generator_adam (clipvalue=0.5)" in lines[1], lines
