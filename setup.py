"""The native data path (src/hpkv/native/records.c), built with the system's C compiler by ``pip install .``;
everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hpkv.native._records",
            ["src/hpkv/native/records.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=["-pthread"],
            libraries=["dl"],
        )
    ]
)
