"""What a results file says about its machine: a CPU named beyond a VM's generic model name."""
from lantern.backends.environment import cpu_description, cpu_features, provenance

SAPPHIRE = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile

processor\t: 1
cpu family\t: 6
model\t\t: 1
flags\t\t: fpu
"""


def test_cpus_sharing_a_model_name_are_told_apart_by_family_model_and_matrix_extensions():
    assert cpu_features(SAPPHIRE) == "family 6 model 207; AMX-BF16 AVX512-BF16 AVX-512 AVX2"
    older = SAPPHIRE.replace("model\t\t: 207", "model\t\t: 85").replace(" avx512_bf16 amx_bf16 amx_tile", "")
    assert cpu_features(older) == "family 6 model 85; AVX-512 AVX2"
    assert cpu_features("") is None


def test_the_provenance_names_the_cpu_with_its_features():
    machine = provenance()["machine"]
    assert machine.startswith(cpu_description()) and "logical cores" in machine
