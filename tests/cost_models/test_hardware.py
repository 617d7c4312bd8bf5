import pytest

from autoshard.cost_models import hardware
from autoshard.errors import AutoshardError


def test_every_profile_loads_with_facts_values():
    assert set(hardware.known()) >= {"a100", "h100", "h800", "h200", "b200", "gb200-nvl72", "cpu"}
    h100, h800 = hardware.load("h100"), hardware.load("h800")
    assert h100.peak_flops("bf16") == 989e12 and h100.peak_flops("fp8") == 1979e12
    assert (h100.nvlink_gbps, h800.nvlink_gbps) == (450, 200)
    assert h800.peak_tflops == h100.peak_tflops  # inherited through `extends`
    assert hardware.load("gb200-nvl72").nvlink_domain == 72
    assert hardware.load("h200").hbm_gb == 141


def test_profile_by_path_and_extends(tmp_path):
    f = tmp_path / "slow.toml"
    f.write_text('name = "slow"\nextends = "h100"\nnvlink_gbps = 50\n')
    hw = hardware.load(str(f))
    assert hw.name == "slow" and hw.nvlink_gbps == 50 and hw.hbm_gb == 80


@pytest.mark.parametrize(
    "text,message",
    [
        ('name = "x"\nextends = "h100"\nnvlink_gbs = 5\n', "unknown field 'nvlink_gbs'; did you mean 'nvlink_gbps'"),
        ('name = "x"\npeak_tflops = { bf16 = 1 }\nhbm_gb = 1\n', "missing field 'hbm_gbps'"),
        ('name = "x"\nextends = "h100"\nhbm_gb = -80\n', "'hbm_gb' must be positive"),
        ('name = "x"\nextends = "h100"\nhbm_gb = "lots"\n', "'hbm_gb' must be a number"),
        ('name = "x\nextends = h100\n', "malformed TOML"),
        ('name = "x"\nextends = "nope"\n', "extends unknown profile 'nope'"),
    ],
)
def test_bad_profiles_name_the_field_and_file(tmp_path, text, message):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(AutoshardError, match="bad.toml") as e:
        hardware.load(str(f))
    assert message in str(e.value)


def test_unknown_name_lists_known_profiles():
    with pytest.raises(AutoshardError, match="unknown hardware 'h900'; known profiles: a100, b200"):
        hardware.load("h900")
