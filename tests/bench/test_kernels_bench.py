"""``ftitan bench kernels --quick``: every kernel case runs (Triton interpreter on the CPU) and the JSON has a
reference/kernel ratio for each mode and the kernels' outputs and gradients agree with the references; times are not judged (the interpreter's mean nothing)."""

import json

from ftitan.__main__ import main


def test_quick_run_writes_ratios_for_every_kernel(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--quick", "--rounds", "1", "--warmup", "0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["bench"] == "kernels" and result["config"]["quick"]
    from ftitan.bench.kernels import CASES

    assert set(result["results"]) == set(CASES)
    for name, peers in result["results"].items():
        modes = {k.split("/", 1)[1] for k in peers}
        for mode in modes:
            assert f"{name}: reference/kernel ({mode})" in result["ratios"]
            assert result["results"][name][f"kernel/{mode}"]["median_s"] > 0
        # fp32 in the interpreter: the kernels agree with their references to float rounding
        assert max(result["errors"][name].values()) < 1e-3, (name, result["errors"][name])
    assert json.loads(capsys.readouterr().out) == result
