"""Settings of the CPU engine that decide its speed on a small machine."""

from __future__ import annotations

import pytest

from batchjson.engine import cpu_dtype

ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: avx512f amx_bf16 amx_tile\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16\n"


@pytest.mark.parametrize("cpuinfo, wanted", [(ZEN3, "float32"), (ZEN4, "auto"), (SAPPHIRE, "auto"), (ARM, "auto")])
def test_auto_dtype_is_float32_only_where_the_cpu_lacks_bfloat16(tmp_path, cpuinfo, wanted):
    info = tmp_path / "cpuinfo"
    info.write_text(cpuinfo)
    assert cpu_dtype("auto", str(info)) == wanted


def test_an_explicit_dtype_is_kept(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(ZEN3)
    assert cpu_dtype("bfloat16", str(info)) == "bfloat16"
    assert cpu_dtype("auto", str(tmp_path / "missing")) == "auto"
