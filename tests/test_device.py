"""Naming the device: two CPUs that both call themselves "AMD EPYC" must not read the same."""

from s3djax.device import cpu_caches, cpu_name

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse avx2 fma avx512f avx512bw
processor\t: 1
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse avx2 fma avx512f avx512bw
"""


def test_family_model_and_vector_unit_tell_two_epycs_apart():
    assert cpu_name(ZEN4) == "AMD EPYC (family 25 model 17, AVX-512)"
    zen2 = ZEN4.replace("25", "23").replace("17", "49").replace(" avx512f avx512bw", "")
    assert cpu_name(zen2) == "AMD EPYC (family 23 model 49, AVX2)"


def test_what_cpuinfo_lacks_is_left_out():
    assert cpu_name("model name\t: Neoverse-V2\n") == "Neoverse-V2"
    assert cpu_name("") == "cpu"


def test_cache_sizes_come_from_sysfs_and_an_unreadable_tree_gives_none(tmp_path):
    for index, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
                                                 (3, "Unified", "266240K")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (folder / name).write_text(f"{value}\n")
    (tmp_path / "uevent").write_text("")
    assert cpu_caches(str(tmp_path)) == {"L1d": 48 << 10, "L2": 2 << 20, "L3": 260 << 20}
    (tmp_path / "index2" / "size").write_text("lots\n")
    assert cpu_caches(str(tmp_path)) == {}
    assert cpu_caches(str(tmp_path / "missing")) == {}
