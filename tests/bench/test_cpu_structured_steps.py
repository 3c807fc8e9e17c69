"""benchmarks/cpu_structured_steps.py on a few requests: its outputs are objects the schema accepts, whole
(the grammar ends each at its EOS), and its step loop over the simulated GPU decodes the same tokens with the
schema, without it and with the fill replaced by a fixed time."""

from __future__ import annotations

import pytest

from benchmarks import cpu_structured_steps


@pytest.mark.skipif(cpu_structured_steps.default_tokenizer() is None,
                    reason="the Llama 3.1 tokenizer is in the team's shared/ folder")
def test_a_small_run_of_both_parts(capsys):
    result = cpu_structured_steps.main(["--requests", "3", "--rounds", "1", "--fill-sweep", "1"])
    fill, loop = result["fill"], result["loop"]
    assert fill["steps"] > 10 and 0 < fill["rows_mean"] <= 3  # every output ran to its grammar's end
    assert set(loop) == {"constrained", "unconstrained", "fill 1 ms"}  # the same tokens (checked inside)
    assert loop["constrained"]["mask_ms_mean"] > 0 and loop["unconstrained"]["mask_ms_mean"] == 0
    assert loop["fill 1 ms"]["mask_ms_mean"] >= 1.0
    assert "throughput vs unconstrained" in capsys.readouterr().out
