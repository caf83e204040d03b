import pytest
import torch

from tlt_lightning.models import hardware, resolve_dtype, training_precision
from tlt_lightning.models.hardware import has_fast_bf16


@pytest.mark.parametrize(
    ("flags", "fast"),
    [("fpu avx512f avx512_bf16", True), ("fpu amx_tile amx_bf16", True), ("fpu avx512f", False)],
)
def test_bf16_pays_only_with_native_bf16_instructions(monkeypatch, flags, fast):
    monkeypatch.setattr(hardware, "cpu_info", lambda field: flags if field == "flags" else "")
    assert has_fast_bf16("cpu") is fast
    assert resolve_dtype("auto") == ("bfloat16" if fast else "float32")
    assert training_precision() == ("bf16-mixed" if fast else "32-true")
    # Explicit choices are kept whatever the machine.
    assert resolve_dtype("bfloat16") == "bfloat16" and resolve_dtype(None) is None


def test_this_machine_is_described():
    assert set(hardware.cpu_bf16_instructions()) <= {"amx_bf16", "avx512_bf16"}
    assert hardware.cpu_info("no such field") == ""
    if not torch.cuda.is_available():
        assert has_fast_bf16("cuda") is False


def test_cpu_info_matches_whole_field_names(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: 26\nmodel\t\t: 2\nflags\t\t: fpu avx512_bf16\n"
    )
    real_path = hardware.Path
    monkeypatch.setattr(hardware, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real_path(p))
    assert hardware.cpu_info("model") == "2"  # not "model name"'s value, nor the reverse
    assert hardware.cpu_info("model name") == "AMD EPYC"
    assert hardware.cpu_info("cpu family") == "26"
    assert hardware.cpu_bf16_instructions() == ["avx512_bf16"]


def test_resolve_decode(monkeypatch, caplog):
    from tlt_lightning.models import hardware
    from tlt_lightning.models.hardware import COMPILE_MIN_PARAMETERS, resolve_decode

    big = COMPILE_MIN_PARAMETERS
    assert resolve_decode("lean", "cpu", big) == "lean"
    assert resolve_decode("auto", "cpu", big - 1) == "hf"  # compiling never pays back on a tiny model
    monkeypatch.setattr(hardware, "has_cpp_compiler", lambda: True)
    assert resolve_decode("auto", "cpu", big) == "compiled"
    assert resolve_decode("auto", "cuda", big) == "compiled"
    monkeypatch.setattr(hardware, "has_cpp_compiler", lambda: False)
    with caplog.at_level("WARNING"):
        assert resolve_decode("auto", "cpu", big) == "hf"
        assert resolve_decode("compiled", "cpu", 10) == "hf"
    assert caplog.text.count("no C++ compiler") == 2
    assert resolve_decode("auto", "cuda", big) == "compiled"


def test_has_cpp_compiler_follows_cxx(monkeypatch):
    from tlt_lightning.models.hardware import has_cpp_compiler

    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert not has_cpp_compiler()
    monkeypatch.setenv("CXX", "sh")  # any program on the PATH
    assert has_cpp_compiler()
