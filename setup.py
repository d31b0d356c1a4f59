"""The one compiled part: the Monitor's untimed host steps (`collector/_fast.c`). Optional: a
host without a C compiler installs without it, and every step takes the Python path."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "meshscope.collector._fast",
            ["collector/_fast.c"],
            extra_compile_args=["-O2", "-Wall", "-Werror=implicit-function-declaration"],
            optional=True,
        )
    ]
)
