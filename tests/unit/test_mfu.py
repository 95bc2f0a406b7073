"""MFU (trainer.rules.mfu): a device's peak by name or by train.peak_tflops, and the ratio, never from a
site's word that is not a finite positive number."""

from __future__ import annotations

import math

import pytest

from trainer.rules.config import TrainConfig, TrainerConfig, validate
from trainer.rules.mfu import device_peak_flops, mfu, model_flops_per_token
from trainer.rules.model_config import ModelConfig
from trainer.rules.tables import ConfigError


@pytest.mark.parametrize(("name", "tflops"), [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.4), ("NVIDIA GH200 480GB", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA B200", 2250.0)])
def test_a_known_device_has_its_datasheet_peak(name, tflops):
    assert device_peak_flops(name) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize("name", ["cpu", "NVIDIA GeForce RTX 4090", "", "mps"])
def test_an_unknown_device_has_no_peak_unless_the_config_names_one(name):
    assert device_peak_flops(name) is None
    assert device_peak_flops(name, 0.5) == 0.5e12
    assert device_peak_flops("NVIDIA H100 PCIe", 400.0) == 400e12  # the config wins over the table


def test_mfu_is_tokens_times_flops_over_the_peak():
    fpt = model_flops_per_token(ModelConfig(preset="tiny"), 32)
    assert mfu(2000.0, fpt, 1e10) == pytest.approx(2000.0 * fpt / 1e10)
    assert mfu(3, 4, 24) == 0.5  # ints from JSON are numbers too


@pytest.mark.parametrize("bad", [None, math.nan, math.inf, -1.0, 0.0, True, "1e12", [1e12], {}])
def test_mfu_of_a_number_that_is_not_one_is_none(bad):
    assert mfu(bad, 1e6, 1e12) is None
    assert mfu(1000.0, bad, 1e12) is None
    assert mfu(1000.0, 1e6, bad) is None


@pytest.mark.parametrize("bad", [-1.0, 1e6, math.nan, math.inf])
def test_a_bad_peak_in_the_config_is_refused_naming_the_key(bad):
    with pytest.raises(ConfigError, match=r"train\.peak_tflops"):
        validate(TrainerConfig(train=TrainConfig(peak_tflops=bad)))
