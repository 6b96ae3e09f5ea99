"""The device name runs and benchmarks are grouped by."""

from benchctl.core import telemetry
from benchctl.stages.bench.record import hardware_slug


def _cpuinfo(name: str, family: str, model: str, processors: int = 2) -> str:
    block = f"processor\t: {{i}}\nvendor_id\t: X\ncpu family\t: {family}\nmodel\t\t: {model}\nmodel name\t: {name}\n"
    return "\n".join(block.format(i=i) for i in range(processors)) + "\n"


def test_a_generic_cpu_name_gains_its_family_and_model():
    # Zen 3 and Zen 4 cloud machines both call themselves "AMD EPYC"; their numbers differ
    zen3 = telemetry.cpu_model(_cpuinfo("AMD EPYC", "25", "1"))
    zen4 = telemetry.cpu_model(_cpuinfo("AMD EPYC", "25", "17"))
    assert zen3 == "AMD EPYC family 25 model 1"
    assert zen4 == "AMD EPYC family 25 model 17"
    assert hardware_slug(f"{zen3} (2 cores, 1 threads)") == "amd-epyc-family-25-model-1-2core"


def test_a_name_with_a_model_number_is_kept_as_it_is():
    assert telemetry.cpu_model(_cpuinfo("AMD EPYC 9R45", "26", "2")) == "AMD EPYC 9R45"
    intel = "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"
    assert telemetry.cpu_model(_cpuinfo(intel, "6", "106")) == intel


def test_the_first_processor_block_is_read():
    text = _cpuinfo("AMD EPYC", "25", "1", processors=1) + "\n" + _cpuinfo("Other CPU", "7", "9", processors=1)
    assert telemetry.cpu_model(text) == "AMD EPYC family 25 model 1"


def test_no_model_name_gives_none():
    assert telemetry.cpu_model("processor\t: 0\nFeatures\t: fp asimd\n") is None
    assert telemetry.cpu_model("") is None
