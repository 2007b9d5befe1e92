"""The device a daemon computes on (common/devices.py): the GPUs its placement gave it,
else the CPU; GPUs it was given but cannot use are an error, never a silent CPU run."""

from __future__ import annotations

import pytest
import torch

from rlfleet.common.devices import given_gpus, torch_device


@pytest.mark.parametrize(("value", "gpus"), [(None, ()), ("", ()), ("-1", ()), ("0", ("0",)),
                                             ("2, 3", ("2", "3")), ("GPU-5e1f", ("GPU-5e1f",))])
def test_given_gpus_reads_cuda_visible_devices(value, gpus):
    assert given_gpus({} if value is None else {"CUDA_VISIBLE_DEVICES": value}) == gpus


def test_a_daemon_given_no_gpu_runs_on_the_cpu():
    assert torch_device({}) == "cpu" and torch_device({"CUDA_VISIBLE_DEVICES": ""}) == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA runs the daemon on it")
def test_gpus_torch_cannot_use_are_an_error_naming_them():
    with pytest.raises(RuntimeError, match=r"given GPU\(s\) CUDA_VISIBLE_DEVICES=0,1, but torch cannot use them"):
        torch_device({"CUDA_VISIBLE_DEVICES": "0,1"})
