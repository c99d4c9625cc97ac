"""The installed package: layout, public names, command line."""

import subprocess
import sys

import ftitan as ft


def test_kernels_folder_is_installed_as_ftitan_kernels():
    import ftitan.kernels

    assert ftitan.kernels.__file__.replace("\\", "/").endswith("kernels/__init__.py")


def test_top_level_namespace():
    for name in ["tree", "random", "nn", "models", "optim", "train", "data", "checkpoint"]:
        assert hasattr(ft, name), name


def test_cli_bench_help_and_unknown_command():
    out = subprocess.run([sys.executable, "-m", "ftitan", "bench", "step", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--rounds" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "ftitan", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
