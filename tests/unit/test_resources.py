"""Resources declared on @train: parsed at import, mapped to sbatch options that launcher.* overrides."""

from __future__ import annotations

import pytest

from gwenlake_hpc import Input, Output, train
from gwenlake_hpc.base.errors import TrainDefinitionError
from gwenlake_hpc.authoring.resources import parse_cpu, parse_gpu, parse_memory


def test_memory_forms_in_mib():
    assert parse_memory("32Gi") == 32768
    assert parse_memory("500Mi") == 500
    assert parse_memory("2T") == 2 * 1024 * 1024
    assert parse_memory("1.5G") == 1536
    assert parse_memory(16) == 16384  # a bare number is GiB
    for bad in ("32 GB", "32GB", "lots", "0Mi", "-1Gi", "", True):
        with pytest.raises(TrainDefinitionError, match='"500Mi", "32Gi", "2T"'):
            parse_memory(bad)


def test_cpu_and_gpu_forms():
    assert parse_cpu("8") == 8 and parse_cpu(2) == 2
    for bad in ("500m", "0", "1.5", -1, True):
        with pytest.raises(TrainDefinitionError, match="whole number of CPUs"):
            parse_cpu(bad)
    assert parse_gpu("1") == (1, None) and parse_gpu(2) == (2, None)
    assert parse_gpu("nvidia-a10g:1") == (1, "nvidia-a10g") and parse_gpu("a100") == (1, "a100")
    for bad in ("a100:0", "a 100:1", ":1", "x:y", "1.5", True):
        with pytest.raises(TrainDefinitionError, match="TYPE:COUNT"):
            parse_gpu(bad)


@pytest.mark.parametrize("settings, needle", [
    ({"memory": "32 GB"}, "memory='32 GB'"),
    ({"cpu": "500m"}, "cpu='500m'"),
    ({"gpu": "a100:x"}, "gpu='a100:x'"),
    ({"env": {"1BAD": "x"}}, "not an environment variable name"),
    ({"secrets": "TOKEN"}, "secrets='TOKEN'"),
    ({"secrets": ["TOKEN"], "env": {"TOKEN": "x"}}, "keep it in secrets only"),
    ({"metadata": ["team"]}, "metadata="),
    ({"max_retries": -1}, "max_retries=-1"),
    ({"name": "a", "model": "b"}, "both name the run"),
])
def test_bad_declarations_fail_at_decoration(settings, needle):
    with pytest.raises(TrainDefinitionError) as err:
        train(data=Input("t.rows"), output=Output("t.model"), **settings)(lambda data, output, run: None)
    assert needle in str(err.value)
