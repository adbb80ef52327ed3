"""The emulator generates the same Metal text as the installed MLX, character for character.

``mx.fast.metal_kernel`` cannot run without Metal, but while ``mx.export_function`` traces a function
it builds the kernel anyway and ``verbose=True`` prints the generated source; that is the oracle.
"""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from metal_kernels.emulator import metal_kernel
from metal_kernels.emulator.signature import METAL_ATTRIBUTES

CASES = {
    "plain": dict(
        source="uint i = thread_position_in_grid.x;\nout[i] = a[i] * 2;",
        inputs=[mx.zeros((16,))],
        outputs=[mx.float32],
        template=None,
    ),
    "template_scalar_small_shape": dict(
        source="uint i = thread_position_in_grid.x;\nout[i] = T(a[i] * b + c[0] + c_shape[0] + N);\no2[i] = B;",
        inputs=[mx.zeros((16,), dtype=mx.float16), mx.array(2.0), mx.zeros((3,), dtype=mx.int32)],
        outputs=[mx.bfloat16, mx.uint8],
        template=[("T", mx.bfloat16), ("N", 3), ("B", True)],
    ),
    "strides_ndim_many_outputs": dict(
        source="out[0] = a_strides[0] + a_ndim; o2[0] = 1; o3[0] = 2;",
        inputs=[mx.zeros((4, 4), dtype=mx.int64)],
        outputs=[mx.int64, mx.int32, mx.uint16],
        template=None,
    ),
    "all_attributes": dict(
        source="out[0] = 1; // " + " ".join(a for a, _ in METAL_ATTRIBUTES),
        inputs=[mx.zeros((8,), dtype=mx.uint32)],
        outputs=[mx.float16],
        template=[("T", mx.float32)],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("atomic", [False, True])
def test_generated_source_matches_mlx(case, atomic, tmp_path, capfd):
    c = CASES[case]
    n_in = len(c["inputs"])
    input_names = ["a", "b", "c"][:n_in]
    output_names = ["out", "o2", "o3"][: len(c["outputs"])]
    header = "// header line\n#define SCALE 2\n"
    mlx_kernel = mx.fast.metal_kernel(
        name=f"sig_{case}",
        input_names=input_names,
        output_names=output_names,
        source=c["source"],
        header=header,
        atomic_outputs=atomic,
    )

    def f(*args):
        return mlx_kernel(
            inputs=list(args),
            output_shapes=[(4,)] * len(output_names),
            output_dtypes=c["outputs"],
            grid=(4, 1, 1),
            threadgroup=(4, 1, 1),
            template=c["template"],
            verbose=True,
        )

    capfd.readouterr()
    mx.export_function(str(tmp_path / "k.mlxfn"), f, *c["inputs"])
    printed = capfd.readouterr().out
    m = re.search(r"Generated source code for `[^`]*`:\n```\n(.*)\n```", printed, re.S)
    assert m, printed
    ours = metal_kernel(f"sig_{case}", input_names, output_names, c["source"], header, atomic_outputs=atomic)
    _, text = ours.metal_source(c["inputs"], c["outputs"], c["template"] or [])
    assert text == m.group(1)
